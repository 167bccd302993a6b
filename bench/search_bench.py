"""Does the search fill its budget, keep the GPU busy, and find RMSNorm's win every time?

    python bench/search_bench.py [--gpu-hours 0.1] [--repeat 3] [--cpu] [--out DIR] [-- extra agent tune flags]

Each repeat runs, in a fresh run folder under DIR,

    agent tune --model examples/llama.py --gpu-hours H --planner template,compiler
               --max-candidates 100000 --json --no-integrate

(the candidate cap is set out of the way, so the budget, patience or an exhausted space is what
stops it; the compiler planner is there because torch.compile's result is the baseline the
template planner must beat), and reports from the run's store:

- the stop reason, as a kind: budget, patience, cap, exhausted (with the space's size), other;
- GPU-hours charged against the cap, and the trials run;
- how busy the GPU was over the search's wall time (from the store's `session` event to its
  `stop` event, so profiling and freezing do not count), two ways: `nvidia-smi`'s
  utilization.gpu sampled every 0.5 s in a thread (the share of time a kernel ran, averaged
  over every GPU), and the device time charged to trials (each device's wall time while it ran
  trials) over the search's wall time times the devices used;
- the best RMSNorm speedup and its A/A noise band.

With `--repeat N` the RMSNorm bests are compared: they agree when their noise bands
(speedup x (1 +- band)) overlap. Runs made earlier with the same `--out` are compared too, so
three runs can be three calls (each within a device's time limit). A short table comes last.

`--cpu` runs on the CPU with the small preset (LLAMA_PRESET=small, `--devices cpu`), to check the
script itself: CPU timings say nothing about a GPU, and there is no nvidia-smi to sample.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KINDS = (("device-hours cap", "budget"), ("GPU-hours", "budget"),  # the second: runs stopped before the rename
         ("patience", "patience"), ("candidate cap", "cap"), ("search space exhausted", "exhausted"))


def sample_gpus(stop: threading.Event, samples: list[tuple[float, float]]) -> None:
    """(time, mean utilization.gpu % over every GPU) every 0.5 s until `stop`; nothing without nvidia-smi."""
    while not stop.is_set():
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=5).stdout
            values = [float(v) for v in out.split() if v.strip().replace(".", "", 1).isdigit()]
        except (OSError, subprocess.TimeoutExpired):
            return
        if values:
            samples.append((time.time(), statistics.mean(values)))
        stop.wait(0.5)


def tune_once(out: Path, tag: str, hours: float, cpu: bool, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "agent", "tune", "--model", "examples/llama.py", "--gpu-hours", f"{hours:g}",
           "--planner", "template,compiler", "--max-candidates", "100000", "--runs-dir", str(out / tag),
           "--json", "--no-integrate", *(["--devices", "cpu"] if cpu else []), *extra]
    env = {**os.environ, **({"LLAMA_PRESET": "small"} if cpu else {})}
    print(f"[{time.strftime('%H:%M:%S')}] {tag}: {' '.join(cmd[2:])}", flush=True)
    stop, samples = threading.Event(), []
    sampler = threading.Thread(target=sample_gpus, args=(stop, samples), daemon=True)
    sampler.start()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    finally:
        stop.set()
        sampler.join(10)
    (out / f"{tag}.stdout").write_text(proc.stdout)
    (out / f"{tag}.stderr").write_text(proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{tag}: agent tune exited {proc.returncode}; its output is in {out / tag}.stderr:\n"
                         + proc.stderr[-2000:])
    summary = json.loads(proc.stdout)
    return {"tag": tag, **measure(Path(summary["run"]), samples, hours), "summary_stop": summary["stop_reason"]}


def search_window(run_dir: Path) -> tuple[float, float]:
    """Times of the last `session` event and the `stop` after it (the search itself)."""
    db = sqlite3.connect(f"file:{run_dir / 'trials.sqlite'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT at, kind FROM events WHERE kind IN ('session', 'stop') ORDER BY id").fetchall()
    finally:
        db.close()
    start = max(at for at, kind in rows if kind == "session")
    end = max((at for at, kind in rows if kind == "stop" and at >= start), default=time.time())
    return start, end


def measure(run_dir: Path, samples: list[tuple[float, float]], cap_hours: float) -> dict:
    from tools.runfolder import RunFolder
    store = RunFolder.open(run_dir).store(readonly=True)
    try:
        trials = list(store.trials())
        stop = (store.last_event("stop") or {}).get("reason", "")
    finally:
        store.close()
    start, end = search_window(run_dir)
    wall = max(1e-9, end - start)
    devices = sorted({t.device for t in trials}) or ["?"]
    inside = [u for at, u in samples if start <= at <= end]
    rms = [t for t in trials if "RMSNorm" in t.region and t.ranked]
    best = max(rms, key=lambda t: t.speedup) if rms else None
    return {"run": str(run_dir), "stop": stop, "kind": next((k for p, k in KINDS if stop.startswith(p)), "other"),
            "gpu_hours": sum(t.gpu_seconds for t in trials) / 3600, "cap": cap_hours, "trials": len(trials),
            "wall": wall, "devices": devices,
            "busy_smi": statistics.mean(inside) / 100 if inside else None,
            "busy_store": sum(t.gpu_seconds for t in trials) / (wall * len(devices)),
            "rmsnorm": {"region": best.region, "speedup": best.speedup, "band": best.noise_band or 0.0,
                        "template": best.template, "params": best.params.get("tune") or best.params}
            if best else None}


def agreement(results: list[dict]) -> tuple[bool, str]:
    """Whether every run's RMSNorm best lies in one common band: speedup x (1 +- noise band)."""
    bests = [r["rmsnorm"] for r in results]
    if not all(bests):
        return False, "a run found no passing RMSNorm candidate"
    lo = max(b["speedup"] * (1 - b["band"]) for b in bests)
    hi = min(b["speedup"] * (1 + b["band"]) for b in bests)
    spans = ", ".join(f"{b['speedup']:.2f}x +-{b['band']:.0%}" for b in bests)
    return lo <= hi, f"{spans}: {'overlap' if lo <= hi else 'no common point'} ({lo:.2f}x .. {hi:.2f}x)"


def table(results: list[dict]) -> str:
    head = f"{'run':<6} {'stop':<10} {'GPU-h spent/cap':>16} {'trials':>7} {'busy smi':>9} {'busy store':>11} " \
           f"{'RMSNorm best':>15}"
    lines = [head, "-" * len(head)]
    for r in results:
        smi = f"{r['busy_smi']:.0%}" if r["busy_smi"] is not None else "n/a"
        rms = f"{r['rmsnorm']['speedup']:.2f}x+-{r['rmsnorm']['band']:.0%}" if r["rmsnorm"] else "none"
        lines.append(f"{r['tag']:<6} {r['kind']:<10} {r['gpu_hours']:>8.4f}/{r['cap']:<7g} {r['trials']:>7} "
                     f"{smi:>9} {r['busy_store']:>11.0%} {rms:>15}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu-hours", type=float, default=0.1, help="the GPU-hours cap of each run (default 0.1)")
    ap.add_argument("--repeat", type=int, default=1, help="runs to make and compare (default 1)")
    ap.add_argument("--cpu", action="store_true", help="on the CPU, small preset: checks the script, not the GPU")
    ap.add_argument("--out", type=Path, help="folder for the runs (default runs/search_bench/<time>)")
    args, extra = ap.parse_known_args()
    extra = [x for x in extra if x != "--"]
    if not (args.gpu_hours > 0 and args.gpu_hours < 1e6):
        ap.error(f"--gpu-hours must be a positive number of hours, got {args.gpu_hours:g}")
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    out = args.out or ROOT / "runs" / "search_bench" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    saved = out / "search_bench.json"
    earlier = json.loads(saved.read_text()) if saved.is_file() else []
    results = list(earlier)
    for i in range(args.repeat):  # saved after each run: a later call with the same --out adds to them
        results.append(tune_once(out, f"run{len(results) + 1}", args.gpu_hours, args.cpu, extra))
        saved.write_text(json.dumps(results, indent=1, default=str))
    if earlier:
        print(f"\n{len(earlier)} earlier run(s) in {out} are compared too")
    for r in results:
        print(f"\n== {r['tag']}: {r['run']}\nstop: {r['stop']} ({r['kind']})\n"
              f"GPU-hours charged {r['gpu_hours']:.4f} of {r['cap']:g} ({r['gpu_hours'] / r['cap']:.0%}); "
              f"{r['trials']} trials; search wall {r['wall']:.0f} s on {', '.join(r['devices'])}")
        print(f"busy: nvidia-smi {'n/a' if r['busy_smi'] is None else format(r['busy_smi'], '.0%')}, "
              f"store (device time charged / wall x devices) {r['busy_store']:.0%}")
        if r["rmsnorm"]:
            b = r["rmsnorm"]
            print(f"best {b['region']}: {b['speedup']:.2f}x (noise band +-{b['band']:.1%}), {b['template']} {b['params']}")
    if len(results) > 1:
        same, why = agreement(results)
        print(f"\nRMSNorm bests agree within their noise bands: {'yes' if same else 'NO'}: {why}")
    if args.cpu:
        print("\n(CPU run: CPU timings, not GPU numbers)")
    print("\n" + table(results))


if __name__ == "__main__":
    main()
