"""Parallel scaling of the search on 1, 2, 4 and 8 GPUs of one host, from real `agent tune` runs.

    python bench/scaling_bench.py OUT_DIR [--gpus 1,2,4,8] [--gpu-hours H] [--from-run RUN] [-- extra agent tune flags]
    python bench/scaling_bench.py OUT_DIR --simulate-cpu --gpus 1,2 --gpu-hours 0.02   (the machinery only, no GPU)

Every N must see the same candidates, so the stream is fixed first: `--from-run RUN` takes the
candidates a finished run tried, in the order it first started them; without it, one `agent tune
--model examples/llama.py` with the template planner on one device (`--source-gpu-hours`) makes
them. They are written, numbered in that order, to OUT_DIR/stream/<Region>/NNNNN-<hash>.py.

Then for each N: a fresh run folder OUT_DIR/runs-N/<run> holding a copy of the stream run's
frozen problems (the same inputs, references and tolerances for every N; no trials, no candidates,
no Triton cache) and the stream in its inbox, and `agent tune --resume <run> --planner files
--devices cuda:0,...,cuda:N-1 --no-integrate --json` with the same `--gpu-hours`, `--max-candidates`
(default: the whole stream) and a patience that never fires. (A fresh `agent tune --model ...
--planner files` cannot be fed: its run folder, and so its inbox, is created inside that process.)

Printed per N, from the run's store:
- trials, the search's wall time (first trial start to last trial end) and trials per hour of it;
- scaling efficiency: trials per hour on N / (N x trials per hour on 1);
- GPU busy share per device: the share of the search wall time the device was held to verify or
  time (trial.phases refs + verify + time, by trial.device), min and mean over the N devices;
- GPU-hours charged (sum of trial.gpu_seconds) against the cap, and the overrun per device in
  units of one trial's cost (median trial wall time without worker start): the target is <= 1,
  the cap never exceeded by more than one trial per device.

`--simulate-cpu` runs the same on `--devices cpu,cpu,...` (N CPU slots of one generation). Those
are CPU numbers: the Triton interpreter on shared cores, and every slot is the one device "cpu"
to the budget (charged once for overlapping trials) and to trial.device. They check the bench and
the machinery and say nothing about GPU scaling.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from tune_bench import agent_tune  # noqa: E402

MODEL = "examples/llama.py"
NEVER = "1000000"  # patience that never fires
CPU_BANNER = ("SIMULATED ON THE CPU (--simulate-cpu): CPU numbers (Triton interpreter, N workers sharing this "
              "machine's cores, all slots one device 'cpu' to the budget); they say nothing about GPU scaling")


def make_stream(run_dir: Path, out_dir: Path) -> list[dict]:
    """The candidates `run_dir` tried, once each, in the order it first started them, written
    to OUT_DIR/stream/<Region>/NNNNN-<hash>.py (the files planner reads an inbox in name order)."""
    from tools.runfolder import RunFolder
    run = RunFolder.open(run_dir)
    regions = {p.name for p in run.problems()}
    trials = sorted(run.store(readonly=True).trials(), key=lambda t: t.started_at)
    stream_dir = out_dir / "stream"
    if stream_dir.exists():
        shutil.rmtree(stream_dir)
    stream, seen = [], set()
    for t in trials:
        key = (t.region, t.candidate_hash)
        src = run.candidates_dir / f"{t.candidate_hash}.py"
        if key in seen or t.region not in regions or not src.is_file():
            continue
        seen.add(key)
        dest = stream_dir / t.region / f"{len(stream):05d}-{t.candidate_hash}.py"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
        stream.append({"region": t.region, "hash": t.candidate_hash, "planner": t.planner,
                       "template": t.template, "status": t.status.value, "file": str(dest.relative_to(out_dir))})
    (out_dir / "stream.json").write_text(json.dumps({"from": str(run_dir), "candidates": stream}, indent=1))
    return stream


def fresh_run(stream_run: Path, out_dir: Path, n: int) -> Path:
    """A new run folder with the stream run's frozen problems (copied) and the stream in its inbox."""
    from tools.runfolder import RunFolder
    src = RunFolder.open(stream_run)
    run = RunFolder.create(out_dir / f"runs-{n}", Path(src.info().model_file))
    for name in ("run.json", "hotspots.json"):
        if (src.path / name).is_file():
            shutil.copy2(src.path / name, run.path / name)
    shutil.copytree(src.problems_dir, run.problems_dir)
    if (src.path / "model").is_dir():  # the end-to-end reference (for a later `agent integrate`)
        shutil.copytree(src.path / "model", run.path / "model")
    shutil.copytree(out_dir / "stream", run.inbox)
    return run.path


def analyze(run_dir: Path, devices: list[str], cap_hours: float) -> dict:
    """Throughput, per-device busy share and budget adherence of one run folder, from its store."""
    from tools.runfolder import RunFolder
    trials = list(RunFolder.open(run_dir).store(readonly=True).trials())
    n = len(devices)  # devices as the budget tells them apart (every --simulate-cpu slot is "cpu")
    if not trials:
        return {"trials": 0, "search_wall": 0.0, "per_hour": 0.0, "busy": {d: 0.0 for d in devices},
                "charged_h": 0.0, "cap_h": cap_hours, "trial_s": None, "overrun_trials": None, "statuses": {}}
    start = min(t.started_at for t in trials)
    search_wall = max(t.finished_at for t in trials) - start
    held: dict[str, float] = {d: 0.0 for d in devices}
    for t in trials:
        held[t.device] = held.get(t.device, 0.0) + sum(t.phases.get(k, 0.0) for k in ("refs", "verify", "time"))
    busy = {d: s / search_wall if search_wall > 0 else 0.0 for d, s in held.items()}
    charged = sum(t.gpu_seconds for t in trials)
    trial_s = statistics.median(max(0.0, t.phases.get("wall", t.gpu_seconds) - t.phases.get("start", 0.0))
                                for t in trials)
    over_s = charged - cap_hours * 3600
    statuses: dict[str, int] = {}
    for t in trials:
        statuses[t.status.value] = statuses.get(t.status.value, 0) + 1
    return {"trials": len(trials), "search_wall": search_wall,
            "per_hour": len(trials) / (search_wall / 3600) if search_wall > 0 else 0.0,
            "busy": busy, "charged_h": charged / 3600, "cap_h": cap_hours, "trial_s": trial_s,
            "overrun_s": over_s, "overrun_trials": (over_s / n / trial_s) if trial_s else None,
            "statuses": statuses}


def default_gpus(simulate_cpu: bool) -> list[int]:
    if simulate_cpu:
        return [1, 2]
    import torch
    count = torch.cuda.device_count()
    return [n for n in (1, 2, 4, 8) if n <= count]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Anything after `--` goes to every `agent tune` unchanged "
                                        "(e.g. -- --workers-per-gpu 2).")
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--gpus", help="comma-separated device counts (default: powers of two up to "
                                   "torch.cuda.device_count(); with --simulate-cpu: 1,2)")
    ap.add_argument("--gpu-hours", type=float, default=0.25, help="cap on device time of every N-run, hours")
    ap.add_argument("--max-candidates", type=int, help="candidate cap of every N-run (default: the whole stream)")
    ap.add_argument("--from-run", type=Path, help="take the fixed candidate stream (and the frozen problems) "
                                                  "from this finished run instead of making one")
    ap.add_argument("--source-gpu-hours", type=float,
                    help="budget of the template-planner run that makes the stream on one device "
                         "(default: 1.5 x --gpu-hours, so the stream outlasts every N-run)")
    ap.add_argument("--source-max-candidates", type=int, default=4000, help="candidate cap of that run")
    ap.add_argument("--simulate-cpu", action="store_true",
                    help="use --devices cpu,cpu,... (N CPU slots of one generation) instead of GPUs: checks "
                         "the bench and the machinery only, says nothing about GPU scaling")
    args, extra = ap.parse_known_args()
    extra = [x for x in extra if x != "--"]
    try:
        gpus = [int(x) for x in args.gpus.split(",") if x.strip()] if args.gpus else default_gpus(args.simulate_cpu)
    except ValueError:
        ap.error(f"--gpus {args.gpus!r}: comma-separated integers, e.g. 1,2,4,8")
    if not gpus or min(gpus) < 1:
        ap.error("no device counts to run: this machine sees no GPU (use --simulate-cpu to check the bench "
                 "on the CPU)" if not args.gpus else "--gpus: counts must be 1 or more")
    if not args.simulate_cpu:
        import torch
        if max(gpus) > torch.cuda.device_count():
            ap.error(f"--gpus {max(gpus)}: this machine sees {torch.cuda.device_count()} GPU(s) "
                     "(--simulate-cpu to check the bench on the CPU)")
    out_dir = args.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.simulate_cpu:
        print(f"NOTE: {CPU_BANNER}.", flush=True)

    def devices_for(n: int) -> list[str]:
        return ["cpu"] * n if args.simulate_cpu else [f"cuda:{i}" for i in range(n)]

    # 1. The fixed candidate stream.
    if args.from_run:
        stream_run = args.from_run.resolve()
    else:
        hours = args.source_gpu_hours or 1.5 * args.gpu_hours
        summary, _ = agent_tune(out_dir, "source", ["--model", MODEL, "--planner", "template", "--devices",
                                              devices_for(1)[0], "--runs-dir", str(out_dir / "source"),
                                              "--gpu-hours", str(hours), "--max-candidates",
                                              str(args.source_max_candidates), "--patience", NEVER, *extra])
        stream_run = Path(summary["run"]).resolve()
    stream = make_stream(stream_run, out_dir)
    if not stream:
        sys.exit(f"{stream_run}: no candidates tried there, so no stream (give it a larger budget)")
    regions = sorted({c["region"] for c in stream})
    print(f"stream: {len(stream)} candidates from {stream_run} ("
          + ", ".join(f"{r} {sum(c['region'] == r for c in stream)}" for r in regions) + ")", flush=True)
    cap_candidates = args.max_candidates or len(stream)

    # 2. The same stream, the same problems and the same budget on every N.
    results = []
    for n in gpus:
        devices = devices_for(n)
        run_dir = fresh_run(stream_run, out_dir, n)
        summary, wall = agent_tune(out_dir, f"n{n}", ["--resume", str(run_dir), "--planner", "files", "--devices",
                                                ",".join(devices), "--gpu-hours", str(args.gpu_hours),
                                                "--max-candidates", str(cap_candidates), "--patience", NEVER,
                                                *extra])
        row = {"n": n, "devices": devices, "run": str(run_dir), "stop": summary["stop_reason"],
               "plans": summary.get("plans"), "tune_wall": wall,
               **analyze(run_dir, sorted(set(devices)), args.gpu_hours)}
        results.append(row)
        print(f"  N={n}: {row['trials']} trials in {row['search_wall']:.0f} s, stop: {row['stop']}", flush=True)
    base = next((r["per_hour"] for r in results if r["n"] == 1), None)
    for r in results:
        r["efficiency"] = r["per_hour"] / (r["n"] * base) if base else None
    (out_dir / "scaling_bench.json").write_text(json.dumps(
        {"simulate_cpu": args.simulate_cpu, "stream_from": str(stream_run), "stream": len(stream),
         "gpu_hours": args.gpu_hours, "max_candidates": cap_candidates, "extra": extra, "results": results},
        indent=1, default=str))

    # 3. Details, then the table last.
    for r in results:
        print(f"\n== N={r['n']} ({','.join(r['devices'])}): {r['run']}")
        print(f"stop: {r['stop']}; plans {r['plans']}; agent tune {r['tune_wall']:.0f} s; statuses {r['statuses']}")
        print("busy share (verify+time / search wall): "
              + ", ".join(f"{d} {s:.0%}" for d, s in sorted(r["busy"].items())))
        if r["trial_s"]:
            print(f"one trial's cost (median wall without worker start) {r['trial_s']:.1f} s; charged "
                  f"{r['charged_h'] * 3600:.0f} s of the cap's {r['cap_h'] * 3600:.0f} s")
        if r["stop"].startswith(("planners have nothing new", "candidate cap")):
            print("WARNING: the stream ran out before the GPU-hours cap stopped the run, so its last rounds may "
                  "have left slots idle; make a longer stream (--source-gpu-hours, or a bigger --from-run)")
    if args.simulate_cpu and any(r["n"] > 1 for r in results):
        print("\nNOTE: with --simulate-cpu every slot is the device 'cpu': the budget charges overlapping trials "
              "of the N slots once (so N slots get about N times the trials for the same cap), and the busy share "
              "is of all slots together (up to N x 100%), not per slot.")
    print(f"\n{'N':>2} {'trials':>6} {'search s':>9} {'trials/h':>9} {'eff':>6} {'busy min':>9} {'busy mean':>9} "
          f"{'GPU-h charged/cap':>19} {'overrun':>12}")
    for r in results:
        busy = [r["busy"].get(d, 0.0) for d in sorted(set(r["devices"]))]
        eff = f"{r['efficiency']:.2f}" if r["efficiency"] is not None else "-"
        over = ("-" if r["overrun_trials"] is None else
                f"{r['overrun_trials']:+.2f} tr/dev" if r["overrun_s"] > 0 else "within cap")
        print(f"{r['n']:>2} {r['trials']:>6} {r['search_wall']:>9.0f} {r['per_hour']:>9.0f} {eff:>6} "
              f"{min(busy):>9.0%} {statistics.mean(busy):>9.0%} "
              f"{r['charged_h']:>9.4f}/{r['cap_h']:<9g} {over:>12}")
    print("(eff: trials/h on N / (N x trials/h on 1); overrun: GPU-seconds past the cap per device (as the budget "
          "tells devices apart), in trials of "
          "median cost; target <= 1)")
    if args.simulate_cpu:
        print(CPU_BANNER)


if __name__ == "__main__":
    main()
