"""The search loop's own efficiency on a GPU, from real `agent tune` runs.

    python bench/tune_bench.py OUT_DIR [--gpu-hours H] [--workers 3,6] [-- extra agent tune flags]
    python bench/tune_bench.py OUT_DIR --analyze runs/<run>     (the same tables for a finished run)

For each worker count (sandbox workers sharing each GPU), runs `agent tune --model
examples/llama.py` with the template planner, samples the GPU's own utilisation through NVML
meanwhile, then reads the run's store and prints:
- per region: trials, passing, best speedup (GPU timings, side by side in one worker), the
  trial that found it, and trials per GPU-hour for that region (its trials over the device
  time charged to them);
- the harness: trials per GPU-hour over the whole search, the share of the search's wall time
  a worker held the GPU to verify or time (the device lock), NVML's kernel-active share, and
  the mean seconds per trial of each phase (start, load = import + compile, verify, time,
  verify_outputs = hashing and sending outputs, judge = the parent's comparison).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def nvml_sampler(stop: threading.Event, samples: list[int]) -> None:
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:
        return
    while not stop.wait(0.25):
        samples.append(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)


def agent_tune(out_dir: Path, tag: str, args: list[str]) -> tuple[dict, float]:
    """`agent tune ... --json --no-integrate`: its JSON summary and its wall seconds; its output
    is kept as OUT_DIR/tune-TAG.stdout/.stderr, and a failed run ends the benchmark."""
    cmd = [sys.executable, "-m", "agent", "tune", *args, "--json", "--no-integrate"]
    print(f"[{time.strftime('%H:%M:%S')}] {tag}: agent {' '.join(cmd[3:])}", flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.time() - t0
    (out_dir / f"tune-{tag}.stdout").write_text(proc.stdout)
    (out_dir / f"tune-{tag}.stderr").write_text(proc.stderr)
    if proc.returncode != 0:
        print(proc.stderr[-3000:])
        sys.exit(proc.returncode)
    return json.loads(proc.stdout), wall


def one_run(out_dir: Path, hours: str, workers: int, extra: list[str]) -> dict:
    stop, util = threading.Event(), []
    sampler = threading.Thread(target=nvml_sampler, args=(stop, util), daemon=True)
    sampler.start()
    try:
        summary, wall = agent_tune(out_dir, f"w{workers}", [
            "--model", "examples/llama.py", "--gpu-hours", hours, "--max-candidates", "4000",
            "--workers-per-gpu", str(workers), "--runs-dir", str(out_dir / "runs"), *extra])
    finally:
        stop.set()
    stats = analyze(Path(summary["run"]))
    return {"workers": workers, "wall": wall, "stop": summary["stop_reason"],
            "nvml": statistics.mean(util) if util else None, **stats}


def _held(t) -> float:
    """The trial's share of the device lock in seconds: its timing (alone) and the original's
    answers and its verification (shared, VERIFY_AT_ONCE at a time)."""
    from sandbox.device_lock import VERIFY_AT_ONCE
    return t.phases.get("time", 0.0) + (t.phases.get("refs", 0.0) + t.phases.get("verify", 0.0)) / VERIFY_AT_ONCE


def analyze(run_dir: Path) -> dict:
    """Efficiency and results of one run folder, from its store."""
    from tools.runfolder import RunFolder
    run = RunFolder.open(run_dir)
    trials = sorted(run.store(readonly=True).trials(), key=lambda t: t.finished_at)
    start = min(t.started_at for t in trials)
    search_wall = max(t.finished_at for t in trials) - start
    held = sum(_held(t) for t in trials)
    charged = sum(t.gpu_seconds for t in trials)
    # Steady state: after the last worker (re)start, so start-up does not dilute the rate.
    started = [t.finished_at for t in trials if t.phases.get("start")]
    steady_from = max(started) if started else start
    steady = [t for t in trials if t.finished_at > steady_from]
    steady_wall = max(t.finished_at for t in trials) - steady_from
    steady_rate = len(steady) / (steady_wall / 3600) if steady and steady_wall > 0 else None
    steady_lock = (sum(_held(t) for t in steady) / steady_wall
                   if steady and steady_wall > 0 else None)
    phases = {}
    for key in ("start", "load", "refs", "verify", "time", "verify_outputs", "wall"):
        phases[key] = sum(t.phases.get(key, 0.0) for t in trials) / len(trials)
    phases["judge+wait"] = phases["wall"] - sum(phases[k] for k in ("start", "load", "refs", "verify", "time",
                                                                    "verify_outputs"))
    regions = []
    problems = run.problems()
    for p in problems:
        ts = [t for t in trials if t.region == p.name]
        ok = [t for t in ts if t.ranked]
        row = {"region": p.name, "trials": len(ts), "ok": len(ok),
               "per_gpu_hour": len(ts) / max(1e-9, sum(t.gpu_seconds for t in ts) / 3600)}
        if ok:
            best = max(ok, key=lambda t: t.speedup)
            row.update(best=best.speedup, at=ts.index(best) + 1, error=best.error, tol=str(p.tolerance),
                       template=best.template, params=best.params.get("tune"),
                       per=", ".join(f"{x.workload} {x.baseline_ms:.4f}->{x.candidate_ms:.4f}" for x in best.timings))
        regions.append(row)
    fails: dict[str, int] = {}
    for t in trials:
        if t.status.value != "ok":
            fails[t.status.value] = fails.get(t.status.value, 0) + 1
    return {"search_wall": search_wall, "trials": len(trials), "per_gpu_hour": len(trials) / (search_wall / 3600),
            "lock_share": held / search_wall, "charged_h": charged / 3600, "phases": phases, "regions": regions,
            "fails": fails, "cap_h": problems[0].stop_rule.gpu_hours if problems else None, "steady": {"trials": len(steady), "seconds": steady_wall, "per_gpu_hour": steady_rate,
                                        "lock_share": steady_lock}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--gpu-hours", default="0.05")
    ap.add_argument("--workers", default="0", help="comma-separated workers per GPU (0: automatic)")
    ap.add_argument("--analyze", type=Path, help="only print the tables for this existing run folder")
    args, extra = ap.parse_known_args()
    args.extra = [x for x in extra if x != "--"]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.analyze:
        results = [{"workers": "?", "wall": 0.0, "stop": "(existing run)", "nvml": None, **analyze(args.analyze)}]
    else:
        results = [one_run(args.out_dir, args.gpu_hours, int(w), args.extra) for w in args.workers.split(",")]
    (args.out_dir / "tune_bench.json").write_text(json.dumps(results, indent=1, default=str))
    for r in results:
        print(f"\n== {r['workers'] or 'auto'} workers/GPU: {r['trials']} trials, search {r['search_wall']:.0f} s "
              f"(agent tune {r['wall']:.0f} s), stop: {r['stop']}")
        print(f"trials per GPU-hour {r['per_gpu_hour']:.0f}; GPU held to verify or time {r['lock_share']:.0%} of "
              f"the search's wall time; NVML kernel-active {r['nvml'] if r['nvml'] is None else round(r['nvml'])}%; "
              f"GPU-hours charged {r['charged_h']:.4f} of {r['cap_h'] or args.gpu_hours} (cap frozen with the problems; "
              "a resumed run may have been given another)")
        st = r["steady"]
        if st["per_gpu_hour"]:
            print(f"steady state (after the last worker start): {st['trials']} trials in {st['seconds']:.0f} s, "
                  f"{st['per_gpu_hour']:.0f} per GPU-hour, GPU held {st['lock_share']:.0%}")
        print("mean s per trial: " + ", ".join(f"{k} {v:.3f}" for k, v in r["phases"].items()))
        print(f"{'region':<16} {'trials':>6} {'ok':>4} {'/GPU-h':>7} {'best':>7} {'at':>5} {'error':>9} {'tol':>12}"
              "  template params | per workload ms")
        for x in r["regions"]:
            if "best" not in x:
                print(f"{x['region']:<16} {x['trials']:>6} {x['ok']:>4} {x['per_gpu_hour']:>7.0f} {'-':>7}")
                continue
            print(f"{x['region']:<16} {x['trials']:>6} {x['ok']:>4} {x['per_gpu_hour']:>7.0f} {x['best']:>6.2f}x "
                  f"{x['at']:>5} {x['error']:>9.2g} {x['tol']:>12}  {x['template']} {x['params']} | {x['per']}")
        print(f"rejected: {r['fails']}")


if __name__ == "__main__":
    main()
