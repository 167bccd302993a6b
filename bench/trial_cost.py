"""What one trial costs, phase by phase, at the model's real sizes.

    python bench/trial_cost.py [--model examples/llama.py] [--device auto|cpu|cuda] [--trials 3]
                               [--regions A,B] [--template] [--no-time] [--run runs/<run>]
                               [--budget-ms MS] [--max-seconds 200] [--eager]

Profiles and freezes the model as `agent tune` does (the full preset on CUDA, the small one on
the CPU; `--run` reuses a run folder frozen before), then runs `--trials` trials of each
region's own forward (and, with `--template`, the template planner's first candidate) through
the real trial path (`TrialRunner.run`: worker start, load and compile, the reference's answers,
verification, judging, timing) and prints the median seconds of each phase over the trials,
the device seconds a trial holds, and trials per device-hour at that cost. Phases are the ones
the runner records per trial (`Trial.phases`):

    start           both workers started and every problem registered (once per worker); of which:
      start.worker    the candidate worker's process to its hello (a spare started ahead: what was
                      left of that), of which, in the worker's own account:
        .imports      importing torch and the harness (a worker started afresh)
        .fork         its fork from the configuration's fork server (a forked worker: no imports)
        .setup        dropping privileges and the network, resource limits
        .device       initialising the device (CUDA: its context, the memory cap)
        .triton       importing Triton
      start.register  the candidate worker's registering every problem (its inputs, the region built)
        .files        of which loading each problem's inputs and state
        .import       importing the model file (its libraries load ahead, after the worker's hello)
        .build        building each region on the device
    load            importing the candidate and its first call per input shape (compiles)
    lock_wait       waiting for the device lock (a sibling timing, or two verifying)
    refs            the reference worker's answers on the trial's fresh and perturbed draws
    verify          the verification calls in the candidate's worker (draws included)
    verify_outputs  copying, hashing and sending those outputs
    judge           the tuner's comparison with the references
    time            timing, all of it; of which:
      time.warmup   each workload's first runs of both sides (they size the repetitions)
      time.runs     the timed runs of the original and the candidate, side by side (a run the
                    tuner's clock refutes is repeated in here); of which, host seconds of the
                    reference worker's (on CUDA what launching them cost the host):
        time.draw   drawing fresh inputs per repetition
        time.copy   copying and checksumming each repetition's outputs
      time.spot     the spot check: fetching a repetition's kept output and the original's answer
      time.integrity  asking the candidate's worker whether torch or the harness was patched
      time.control  the A/A run: the original in the candidate's worker
    spot_judge      the spot checks' comparisons (the tuner's CPU, after the device lock is let go); of which:
      spot_wait     waiting for a whole model's timing to end before judging (HostQuiet)
      spot_answer   the original's answer from the reference worker (shared by every lane)
    other           what no phase names (the torch.compile probe, integrity checks, replies)

Two rates: one trial after another (device s / trial), and with sibling workers loading and
compiling meanwhile, as `agent tune` runs them (only refs, verify and time hold the device lock).
Timed trials also give the multiple of one eager call: the trial's device seconds over the
original's median call in the reference worker during that trial (every workload once); with
`--eager`, also over the original's call timed here in the bench (one thread, as the workers
run it; the least of a reading before and one after the trials, so the larger multiple).
The CPU target of issue 49 is read that way: a 256 MB softmax (KernelBench's size),
`NS_SIZE=full python bench/trial_cost.py --model tests/problems/l1_softmax.py --device cpu
--trials 4 --eager`, at most 200 eager calls a trial.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OWN = "def forward(module, *args, **kwargs):\n    return type(module).forward(module, *args, **kwargs)\n"
PHASES = ["start", "start.worker", "start.worker.imports", "start.worker.fork", "start.worker.setup", "start.worker.device",
          "start.worker.triton", "start.register", "start.register.files", "start.register.import", "start.register.build", "load",
          "lock_wait", "refs", "verify", "verify_outputs", "judge", "time", "time.warmup", "time.runs", "time.draw",
          "time.copy", "time.spot", "time.integrity", "time.control", "spot_judge",
          "spot_wait", "spot_answer"]


def freeze(model: Path, device: str, regions: list[str] | None, runs_dir: Path) -> Path:
    from agent.setup.jobs import profile_and_freeze
    t0 = time.monotonic()
    print(f"[trial_cost] profiling and freezing {model} on {device} ...", flush=True)
    out = profile_and_freeze(model, device, None, runs_dir, regions=regions)
    print(f"[trial_cost] froze {len(out.problems)} problems in {time.monotonic() - t0:.1f} s: "
          f"{', '.join(p.name for p in out.problems)}", flush=True)
    return out.run.path


def candidates(problem, template: bool) -> list:
    from agent.history import History
    from tools.trial import Candidate
    out = [("own", Candidate(region=problem.name, source=OWN, planner="manual"))]
    if template:
        from agent.planners.template import TemplatePlanner
        got = TemplatePlanner().propose(problem, History({problem.name: ["this device"]}), 1)
        out += [(f"template {c.template}", c) for c in got[:1]]
    return out


def measure(run: Path, device: str, trials: int, template: bool, do_time: bool, until: float,
            budget_ms: float | None = None) -> list[dict]:
    """One row per trial: what, region, status, device seconds and the phases. Round k runs the
    k-th trial of every region, so a deadline (`until`, monotonic) still leaves each region one."""
    from sandbox.runner import Limits, TrialRunner
    from tools.problem import Problem
    folders = sorted(p.parent for p in (run / "problems").glob("*/problem.json"))
    t0 = time.monotonic()
    runner = TrialRunner(device, Limits(**({"budget_ms": budget_ms} if budget_ms else {})))
    rows: list[dict] = []
    try:
        for f in folders:
            runner.add_problem(f)
        jobs = {Problem.load(f).name: candidates(Problem.load(f), template) for f in folders}
        rounds = [[(name, what, c) for name, cs in jobs.items() for what, c in cs if k == 0 or what == "own"]
                  for k in range(trials)]
        for k, jobs_k in enumerate(rounds):
            for name, what, c in jobs_k:
                if rows and time.monotonic() > until:
                    print(f"[trial_cost] deadline: stopping after {len(rows)} trials", flush=True)
                    return rows
                print(f"[trial_cost] {name} {what} #{k}: running ...", flush=True)
                trial = runner.run(c, do_time=do_time)
                rows.append({"what": what, "region": name, "status": trial.status.value, "reason": trial.reason,
                             "device_s": trial.gpu_seconds, "phases": trial.phases, "speedup": trial.speedup,
                             "eager_s": sum(t.baseline_ms for t in trial.timings) / 1e3 if trial.timings else None,
                             "since_start": time.monotonic() - t0})
                ph = " ".join(f"{k_}={v:.2f}" for k_, v in trial.phases.items())
                print(f"[trial_cost] {name} {what} #{k}: {trial.status.value} {trial.gpu_seconds:.2f} s ({ph})"
                      + (f" {trial.reason[:100]}" if trial.status.value != "ok" else ""), flush=True)
    finally:
        runner.close()
    return rows


def eager_seconds(run: Path, region: str, calls: int = 5) -> float:
    """One call of the region's original forward on each frozen input set, here, with one thread
    as a worker runs it: the median of `calls` calls of each set, summed over the sets."""
    import torch

    from tools.problem import Problem
    from tools.region import build_region, call_args
    folder = run / "problems" / region
    p = Problem.load(folder)
    inputs, _, state = p.load_tensors(folder)
    device = torch.device(p.device if p.device == "cpu" else "cuda")
    module = build_region(p.model_file, p.region_path, state, device, on_meta=p.build_on_meta)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        total = 0.0
        for input_set in inputs:
            times = []
            for _ in range(calls):
                args, kwargs = call_args(input_set, device)
                with torch.no_grad():
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    type(module).forward(module, *args, **kwargs)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            total += statistics.median(times)
        return total
    finally:
        torch.set_num_threads(threads)


def table(rows: list[dict], device: str, eager: dict[str, float] | None = None) -> str:
    """Median seconds per phase over the trials of each region's own forward (a template
    candidate in a column of its own; the worker's start, paid once, a row of its own), and
    trials per device-hour at the median steady-state cost."""
    kind = "CPU" if device == "cpu" else "GPU"
    label = lambda r: r["region"] if r["what"] == "own" else f"{r['region']} ({r['what']})"  # noqa: E731
    regions = list(dict.fromkeys(label(r) for r in rows))
    head = ["phase (median s)"] + regions + ["all"]
    lines = []

    def med(rs: list[dict], key) -> float:
        xs = [key(r) for r in rs]
        return statistics.median(xs) if xs else 0.0

    def steady(r: dict) -> float:
        return max(0.0, r["device_s"] - r["phases"].get("start", 0.0))

    groups = [[r for r in rows if label(r) == g] for g in regions] + [rows]
    for ph in PHASES:
        if not any(ph in r["phases"] for r in rows):
            continue
        if ph.startswith("start"):
            lines.append([ph + " (once)"] + [f"{max((r['phases'].get(ph, 0.0) for r in g), default=0):.2f}"
                                             for g in groups])
        else:
            lines.append([ph] + [f"{med(g, lambda r: r['phases'].get(ph, 0.0)):.2f}" for g in groups])
    top = [p for p in PHASES if "." not in p and p != "start"]
    lines.append(["other (unnamed)"] + [f"{med(g, lambda r: steady(r) - sum(r['phases'].get(p, 0.0) for p in top)):.2f}"
                                        for g in groups])
    lines.append(["device s / trial"] + [f"{med(g, steady):.2f}" for g in groups])
    lines.append([f"trials / device-hour ({kind})"] + [f"{3600 / max(med(g, steady), 1e-9):.0f}" for g in groups])
    # One eager call, two ways: here in the bench, one thread, the least of its readings before
    # and after the trials (the multiple a quiet machine would show: the larger); and the
    # original's median call in the reference worker during each trial's own timing (the load
    # the trial met, on both sides of the ratio).
    if eager:
        own = [eager.get(r) if r in eager else None for r in regions] + [None]
        lines.append(["eager call here (s, 1 thread)"] + [f"{e:.3f}" if e else "-" for e in own])
        lines.append(["device s / trial, in those calls"] + [f"{med(g, steady) / e:.0f}x" if e else "-"
                                                            for g, e in zip(groups, own)])
    timed = [[r for r in g if r.get("eager_s")] for g in groups]
    if any(timed):
        lines.append(["eager call in the trial (s)"] + [f"{med(g, lambda r: r['eager_s']):.3f}" if g else "-"
                                                       for g in timed])
        lines.append(["device s / trial, in those calls"] + [f"{med(g, lambda r: steady(r) / r['eager_s']):.0f}x"
                                                            if g else "-" for g in timed])
    # What holds the device lock: the bound when sibling workers load and compile meanwhile (a
    # timing alone, verifications VERIFY_AT_ONCE at a time).
    from sandbox.device_lock import VERIFY_AT_ONCE
    locked = lambda r: (r["phases"].get("time", 0.0)  # noqa: E731
                        + sum(r["phases"].get(p, 0.0) for p in ("refs", "verify")) / VERIFY_AT_ONCE)
    lines.append([f"locked s / trial (verifying {VERIFY_AT_ONCE} at once)"] + [f"{med(g, locked):.2f}" for g in groups])
    lines.append(["  ... / device-hour, loads overlapped"] + [f"{3600 / max(med(g, locked), 1e-9):.0f}" for g in groups])
    lines.append(["status"] + [",".join(sorted({r['status'] for r in g})) for g in groups])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]

    def fmt(row: list) -> str:
        return "  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(row, widths)))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(x) for x in lines])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "examples" / "llama.py")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--regions", default="", help="module classes to freeze (default: the profile's choice)")
    ap.add_argument("--template", action="store_true", help="also one template candidate per region")
    ap.add_argument("--no-time", action="store_true", help="verification only")
    ap.add_argument("--run", type=Path, default=None, help="a run folder frozen before (skips the profile)")
    ap.add_argument("--budget-ms", type=float, default=None, help="timing budget per workload (default: Limits')")
    ap.add_argument("--eager", action="store_true",
                    help="also time each region's original forward here, one thread, before and after the trials")
    ap.add_argument("--max-seconds", type=float, default=200.0,
                    help="start no trial after this many seconds (the freeze included); the table follows")
    args = ap.parse_args(argv)
    import torch
    device = "cuda:0" if args.device in ("auto", "cuda") and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    t0 = time.monotonic()
    run = args.run or freeze(args.model, device, [r for r in args.regions.split(",") if r] or None,
                             Path(tempfile.mkdtemp(prefix="nightshift-trial-cost-")))
    frozen_s = time.monotonic() - t0
    names = sorted(f.parent.name for f in (run / "problems").glob("*/problem.json"))
    eager = {n: eager_seconds(run, n) for n in names} if args.eager else {}
    rows = measure(run, device, args.trials, args.template, not args.no_time, t0 + args.max_seconds, args.budget_ms)
    eager = {n: min(e, eager_seconds(run, n)) for n, e in eager.items()}
    first = rows[0]["since_start"] if rows else float("nan")
    print(f"\ntrial cost: {args.model.name} on {device} ({'CPU timings' if device == 'cpu' else 'GPU'}), "
          + (f"preset {os.environ.get('LLAMA_PRESET') or ('full' if device != 'cpu' else 'small')}, "
             if args.model.name == "llama.py" else "")
          + f"{len(rows)} trials; freeze {frozen_s:.1f} s; first trial done {first:.1f} s after the runner started")
    print(table(rows, device, eager))
    bad = [r for r in rows if r["what"] == "own" and r["status"] != "ok"]
    for r in bad:
        print(f"NOT OK: {r['region']} own forward: {r['status']}: {r['reason'][:200]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
