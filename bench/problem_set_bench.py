"""Models nobody here wrote, end to end on one device: tune each model file, then time the
tuned model against eager and every torch.compile mode side by side.

    python bench/problem_set_bench.py OUT_DIR MODEL.py [MODEL.py ...] [--candidates N] [--gpu-hours H]
        [--parallel K] [--modes all|torch.compile,...] [--again]

For each model file: `agent tune --model F` (template and compiler planners) with its
integration and the compile baselines (`--modes`, default every mode), as a user runs it: the
baselines compile beside the search and the ways with our kernels start from their caches.
Every number comes from one run of the sandbox's trial path. `--parallel K`: tunes run K at a
time on the one GPU (`--no-integrate`, two workers each, their timings kept apart by the device
lock; the others' compiles may still run beside a region's timing), then the wave's
integrations one by one with nothing else on the device, so the end-to-end numbers are as
clean as with K = 1.

Each problem's row is appended to OUT_DIR/rows.jsonl as it ends, and a problem with a row
there is not run again (unless `--again`): a set too long for one device lease is run over
several with the same OUT_DIR, and the table covers every row. Prints one table last: regions
kept, trials, best region, the tuned model's weighted speedup over eager, the best compile
mode's, ours against it, and fast_1 (something applied, correct, and faster than the best compile
mode beyond the tuned model's noise band); then fast_1 and the geometric mean over compile per level (files
named l1_, l2_, l3_; others are models).
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
opts = {"--candidates": "24", "--gpu-hours": "0.02", "--planner": "template,compiler", "--parallel": "1",
        "--modes": "all"}
for key in list(opts):
    if key in args:
        i = args.index(key)
        opts[key] = args[i + 1]
        del args[i:i + 2]
again = "--again" in args
args = [a for a in args if a != "--again"]
models = [Path(a) for a in args]
missing = [str(m) for m in models if not m.is_file()]
if missing:
    sys.exit(f"no such model file: {', '.join(missing)}")
from agent.review.ways import BASELINES  # noqa: E402
modes = list(BASELINES) if opts["--modes"] == "all" else [m.strip() for m in opts["--modes"].split(",") if m.strip()]
if unknown := [m for m in modes if m not in BASELINES]:
    sys.exit(f"--modes: {', '.join(unknown)} not one of {', '.join(BASELINES)} (or all)")
rows_file = out_dir / "rows.jsonl"
kept_rows = [json.loads(line) for line in rows_file.read_text().splitlines() if line.strip()] if rows_file.is_file() else []
done = {r["problem"] for r in kept_rows if "error" not in r}
if not again and (skip := [m.stem for m in models if m.stem in done]):
    print(f"already in {rows_file} (--again runs them anew): {', '.join(skip)}")
    models = [m for m in models if m.stem not in done]
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
    # Its cap goes with the row: rows from several leases (and settings) make one table.
    row = {"problem": model.stem, "cap_gpu_hours": float(opts["--gpu-hours"]), "cap_candidates": int(opts["--candidates"])}
    # Tunes run side by side in waves: they share the GPU explicitly (each sees the others'
    # memory), with fewer workers each; the device lock keeps their timings apart.
    shared = ["--devices", "cuda:0", "--workers-per-gpu", "2"] if parallel > 1 and _cuda() else []
    # One at a time, the tune integrates itself (its baselines compile beside its search).
    ending = ["--no-integrate"] if parallel > 1 else ["--baselines", "--compile-modes", ",".join(modes)]
    done = subprocess.run([sys.executable, "-m", "agent", "tune", "--model", str(model), "--runs-dir", str(runs_dir),
                           "--max-candidates", opts["--candidates"], "--gpu-hours", opts["--gpu-hours"],
                           "--planner", opts["--planner"], "--json", *ending, *shared],
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
    """The tune's own integration (one tune at a time), or integration with the chosen compile
    baselines with nothing else on the device (after a wave of tunes side by side)."""
    from agent.review.integrate import integrate  # noqa: E402
    from tools.e2e import IntegrationResult  # noqa: E402
    from tools.runfolder import RunFolder  # noqa: E402
    t0 = time.time()
    if parallel == 1:
        res = IntegrationResult.load(Path(summary["run"]))
        if res is None:
            row.update(error=f"integrate: {str(summary.get('integration') or 'no integration.json')[:160]}")
            return row
    else:
        try:
            res = integrate(RunFolder.open(Path(summary["run"])), None, baselines=True, modes=modes,
                            cuda_graphs=False, on_step=step)
        except Exception as e:  # a model whose integration fails is a row with its reason, not the end
            row.update(error=f"integrate: {type(e).__name__}: {str(e)[:160]}")
            return row
    w = {x.name: x.weight for x in res.workloads}
    total = sum(w.values()) or 1.0
    eager = sum(x.weight * x.eager_ms for x in res.workloads) / total
    tuned = sum(x.weight * (x.tuned_ms or math.inf) for x in res.workloads) / total
    # The best compile mode by its weighted time (a mode that failed on any workload is out).
    weighted = {m: sum(x.weight * x.baselines[m] for x in res.workloads) / total for m in modes
                if all(x.baselines.get(m) for x in res.workloads)}
    best_mode = min(weighted, key=weighted.get) if weighted else None
    comp_ms = weighted.get(best_mode)
    band = res.noise_band or 0.0
    row.update(regions=[a.region for a in res.accepted], accepted=len(res.accepted),
               eager_ms=round(eager, 4), tuned_ms=round(tuned, 4), speedup=round(eager / tuned, 3),
               band=round(band, 4), verdict="faster" if eager / tuned > 1 + band else
               ("slower" if eager / tuned < 1 / (1 + band) else "no change"),
               compile_mode=best_mode, compile_ms=comp_ms and round(comp_ms, 4),
               compile_speedup=comp_ms and round(eager / comp_ms, 3),
               vs_compile=comp_ms and round(comp_ms / tuned, 3), compile_errors=res.baseline_errors,
               dropped=[f"{d.region}: {d.reason[:60]}" for d in res.dropped][:3],
               seconds=row.get("tune_s", 0) + round(time.time() - t0))
    row["fast_1_eager"] = row["verdict"] == "faster"
    # Against the best compile mode (every mode failed: against eager, as a user without one),
    # and only where something was applied: the untouched model beating the compiler is not ours.
    row["fast_1"] = bool(res.accepted) and (comp_ms / tuned if comp_ms else eager / tuned) > 1 + band
    return row


for at in range(0, len(models), parallel):
    wave = models[at:at + parallel]
    with ThreadPoolExecutor(len(wave)) as pool:
        tuned_wave = list(pool.map(tune, wave))
    for row, summary in tuned_wave:  # one at a time, after the wave's tunes have ended
        if summary is not None:
            row = integrate_row(row, summary)
        rows.append(row)
        with rows_file.open("a") as f:
            f.write(json.dumps(row) + "\n")
        con.print(row)

# Every problem's newest row, from this run and the earlier ones in OUT_DIR.
newest = {r["problem"]: r for r in [*kept_rows, *rows]}
rows = list(newest.values())

table = Table(title="problem set, end to end (weighted over workloads), one device, side by side in one run each")
for col in ("problem", "cap h", "regions kept", "trials", "best region", "eager ms", "tuned ms", "tuned", "band",
            "best compile mode", "compile ms", "compile", "ours vs compile", "fast_1", "s"):
    table.add_column(col)
for r in rows:
    cap = f"{r['cap_gpu_hours']:g}" if "cap_gpu_hours" in r else "?"
    if "error" in r:
        table.add_row(r["problem"], cap, r["error"][:60], *[""] * 12)
        continue
    best = max((r.get("best") or {}).values(), default=0.0)
    table.add_row(r["problem"], cap, ",".join(r["regions"]) or "-", str(r["trials"]), f"{best:.2f}x",
                  f"{r['eager_ms']:.4f}", f"{r['tuned_ms']:.4f}",
                  r["verdict"] if r["verdict"] == "no change" else f"{r['speedup']:.2f}x", f"±{r['band']:.1%}",
                  r.get("compile_mode") or "every mode failed",
                  f"{r['compile_ms']:.4f}" if r.get("compile_ms") else "-",
                  f"{r['compile_speedup']:.2f}x" if r.get("compile_speedup") else "-",
                  f"{r['vs_compile']:.2f}x" if r.get("vs_compile") else "-", "yes" if r.get("fast_1") else "no",
                  str(r["seconds"]))
con.print(table)


def level(problem: str) -> str:
    return next((f"level {n}" for n in "123" if problem.startswith(f"l{n}_")), "models")


for name in sorted({level(r["problem"]) for r in rows}):
    group = [r for r in rows if level(r["problem"]) == name]
    ok = [r for r in group if "error" not in r]
    vs = [r["vs_compile"] for r in ok if r.get("vs_compile")]
    con.print(f"{name}: fast_1 against the best compile mode {sum(bool(r.get('fast_1')) for r in ok)}/{len(group)}"
              f" ({sum(bool(r.get('fast_1')) for r in ok) / len(group):.0%}); errors {len(group) - len(ok)}"
              + (f"; geometric mean over the best compile mode {math.exp(sum(map(math.log, vs)) / len(vs)):.3f}x"
                 if vs else "")
              + (f"; over eager {math.exp(sum(math.log(r['speedup']) for r in ok) / len(ok)):.3f}x" if ok else ""))
