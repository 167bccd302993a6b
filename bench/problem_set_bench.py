"""Models nobody here wrote, end to end on one device: tune each model file, then time
the tuned model against eager and torch.compile's default mode side by side.

    python bench/problem_set_bench.py OUT_DIR MODEL.py [MODEL.py ...] [--candidates N] [--gpu-hours H]
        [--parallel K]

For each model file: `agent tune --model F --no-integrate` (template and compiler planners),
then integration with the torch.compile default baseline, every number from one run of the
sandbox's trial path. `--parallel K`: tunes run K at a time on the one GPU (two workers each,
their timings kept apart by the device lock; the others' compiles may still run beside a
region's timing), then the wave's integrations one by one with nothing else on the device, so
the end-to-end numbers are as clean as with K = 1. Prints one table last: regions frozen, trials, best region speedup, the
tuned model's weighted speedup over eager (or "no change" inside its noise band), compile's,
ours against compile, and fast_1 (correct and faster than eager beyond the noise band).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

args = [a for a in sys.argv[1:]]
out_dir = Path(args.pop(0))
out_dir.mkdir(parents=True, exist_ok=True)
opts = {"--candidates": "24", "--gpu-hours": "0.02", "--planner": "template,compiler", "--parallel": "1"}
for key in list(opts):
    if key in args:
        i = args.index(key)
        opts[key] = args[i + 1]
        del args[i:i + 2]
models = [Path(a) for a in args]
parallel = max(1, int(opts["--parallel"]))
con = Console(width=220)
runs_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"nightshift-set-{os.getpid()}"
rows = []
env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}


def step(line: str) -> None:
    con.print(f"  [{time.strftime('%H:%M:%S')}] {line}", markup=False)


def tune(model: Path) -> tuple[dict, dict | None]:
    """`agent tune` of one model file: (its row so far, its summary or None)."""
    t0 = time.time()
    row = {"problem": model.stem}
    # Tunes run side by side in waves: they share the GPU explicitly (each sees the others'
    # memory), with fewer workers each; the device lock keeps their timings apart.
    shared = ["--devices", "cuda:0", "--workers-per-gpu", "2"] if parallel > 1 and _cuda() else []
    done = subprocess.run([sys.executable, "-m", "agent", "tune", "--model", str(model), "--runs-dir", str(runs_dir),
                           "--max-candidates", opts["--candidates"], "--gpu-hours", opts["--gpu-hours"],
                           "--planner", opts["--planner"], "--no-integrate", "--json", *shared],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    (out_dir / f"{model.stem}.tune.log").write_text(done.stdout[-20000:] + "\n--- stderr\n" + done.stderr[-20000:])
    row["tune_s"] = round(time.time() - t0)
    try:
        summary = json.loads(done.stdout)
    except ValueError:
        row.update(error=f"tune exit {done.returncode}: {(done.stderr.strip().splitlines() or ['?'])[-1][:160]}")
        return row, None
    row.update(trials=summary.get("trials"), stop=summary.get("stop_reason", "")[:60],
               best={k: round(v, 3) for k, v in (summary.get("best_speedup") or {}).items()})
    return row, summary


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def integrate_row(row: dict, summary: dict) -> dict:
    """Integration with the torch.compile default baseline, with nothing else on the device."""
    from agent.integrate import integrate  # noqa: E402
    from tools.runfolder import RunFolder  # noqa: E402
    t0 = time.time()
    try:
        res = integrate(RunFolder.open(Path(summary["run"])), None, baselines=True, modes=["torch.compile"],
                        cuda_graphs=False, on_step=step)
    except Exception as e:  # a model whose integration fails is a row with its reason, not the end
        row.update(error=f"integrate: {type(e).__name__}: {str(e)[:160]}")
        return row
    w = {x.name: x.weight for x in res.workloads}
    total = sum(w.values()) or 1.0
    eager = sum(x.weight * x.eager_ms for x in res.workloads) / total
    tuned = sum(x.weight * (x.tuned_ms or math.inf) for x in res.workloads) / total
    comp = [x.baselines.get("torch.compile") for x in res.workloads]
    comp_ms = sum(x.weight * c for x, c in zip(res.workloads, comp)) / total if all(comp) else None
    band = res.noise_band or 0.0
    row.update(regions=[a.region for a in res.accepted], accepted=len(res.accepted),
               eager_ms=round(eager, 4), tuned_ms=round(tuned, 4), speedup=round(eager / tuned, 3),
               band=round(band, 4), verdict="faster" if eager / tuned > 1 + band else
               ("slower" if eager / tuned < 1 / (1 + band) else "no change"),
               compile_ms=comp_ms and round(comp_ms, 4), compile_speedup=comp_ms and round(eager / comp_ms, 3),
               vs_compile=comp_ms and round(comp_ms / tuned, 3), compile_error=res.baseline_errors.get("torch.compile"),
               dropped=[f"{d.region}: {d.reason[:60]}" for d in res.dropped][:3],
               seconds=row.get("tune_s", 0) + round(time.time() - t0))
    row["fast_1"] = row["verdict"] == "faster"
    return row


for at in range(0, len(models), parallel):
    wave = models[at:at + parallel]
    with ThreadPoolExecutor(len(wave)) as pool:
        tuned_wave = list(pool.map(tune, wave))
    for row, summary in tuned_wave:  # one at a time, after the wave's tunes have ended
        if summary is not None:
            row = integrate_row(row, summary)
        rows.append(row)
        with (out_dir / "rows.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        con.print(row)

table = Table(title="problem set, end to end (weighted over workloads), one device, side by side in one run each")
for col in ("problem", "regions kept", "trials", "best region", "eager ms", "tuned ms", "tuned", "band",
            "compile ms", "compile", "ours vs compile", "s"):
    table.add_column(col)
for r in rows:
    if "error" in r:
        table.add_row(r["problem"], r["error"][:60], "", "", "", "", "", "", "", "", "", "")
        continue
    best = max((r.get("best") or {}).values(), default=0.0)
    table.add_row(r["problem"], ",".join(r["regions"]) or "-", str(r["trials"]), f"{best:.2f}x",
                  f"{r['eager_ms']:.4f}", f"{r['tuned_ms']:.4f}",
                  r["verdict"] if r["verdict"] == "no change" else f"{r['speedup']:.2f}x", f"±{r['band']:.1%}",
                  f"{r['compile_ms']:.4f}" if r["compile_ms"] else "failed",
                  f"{r['compile_speedup']:.2f}x" if r["compile_speedup"] else "-",
                  f"{r['vs_compile']:.2f}x" if r["vs_compile"] else "-", str(r["seconds"]))
con.print(table)
ok = [r for r in rows if "error" not in r]
if ok:
    con.print(f"fast_1 over eager: {sum(r['fast_1'] for r in ok)}/{len(rows)} problems "
              f"({sum(r['fast_1'] for r in ok) / len(rows):.0%}); errors: {len(rows) - len(ok)}")
    geo = math.exp(sum(math.log(r["speedup"]) for r in ok) / len(ok))
    vs = [r["vs_compile"] for r in ok if r["vs_compile"]]
    con.print(f"geometric mean over eager {geo:.3f}x" + (f"; over compile {math.exp(sum(map(math.log, vs)) / len(vs)):.3f}x"
                                                         if vs else ""))
