"""The tuned example against eager and every torch.compile mode on served traffic.

    python bench/traffic_bench.py OUT_DIR [--trace examples/traces/agent.jsonl] [--gpu-hours 0.03]
        [--regions LlamaAttention,LlamaMLP] [--modes torch.compile,max-autotune-no-cudagraphs,reduce-overhead]
        [--no-model-workloads] [--device cuda]

One process: `agent tune` (library calls, the template planner) on examples/llama.py with the
trace's workload mix (`--workloads TRACE`: the shapes its requests group into, weighted by the
calls each costs, tools/traffic.py) plus, at weight 0, the model's own KV-cache workloads
(prefill 1x2048, decode 32x1 over 4096, long_prefill 1x16384, small_batch 8x128 after 896);
then integration (agent/review/integrate.py): the winners routed into the model, verified end to
end, and timed side by side with the untouched model in one worker, A/A noise band included,
and torch.compile of the untouched model in each mode timed the same way.

Prints one table: per workload (weight, eager ms, tuned ms and speedup, each compile mode's ms
and speedup, noise band), and the trace's weighted total (sum of weight x ms: the device time
the trace would cost) per way of running. Also writes OUT_DIR/traffic.json and the run's report.

On a CPU (a proof that it runs, not GPU numbers): LLAMA_PRESET=small LLAMA_LAYERS=1 and
`--gpu-hours 0.002 --modes torch.compile --device cpu`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def tune(out: Path, args) -> Path:
    from agent.cli.session import TuneRequest, tune_session
    given = {"planner": "template", "gpu_hours": args.gpu_hours, "max_candidates": args.max_candidates,
             "patience": args.patience, "devices": args.device if args.device != "auto" else None}
    req = TuneRequest(model=ROOT / "examples" / "llama.py", given=given, device=args.device,
                      regions=[r for r in args.regions.split(",") if r] or None, max_regions=3,
                      runs_dir=out / "runs", integrate=False, trace=Path(args.trace),
                      trace_keep_own=args.model_workloads)
    res = tune_session(req, say=lambda text: print(f"  {text}", flush=True),
                       warn=lambda text: print(f"  note: {text}", flush=True))
    if res.outcome.planner_failure:
        print(f"  planner failure: {res.outcome.planner_failure}")
    return res.run.path


def table(result, trace: str) -> list[str]:
    from agent.review.ways import BASELINES
    from agent.report.numbers import weighted_totals
    modes = [n for n in BASELINES if any(n in w.baselines for w in result.workloads)]
    unit = "CPU ms" if result.timing_kind == "cpu" else "ms"
    head = ["workload", "weight", f"eager {unit}", "tuned", *modes, "noise band"]
    rows = []
    for w in result.workloads:
        cells = [w.name, f"{w.weight:.1f}", f"{w.eager_ms:.4f}",
                 "-" if w.tuned_ms is None else f"{w.tuned_ms:.4f} ({w.speedup:.2f}x)"]
        for m in modes:
            ms, sp = w.baselines.get(m), w.baseline_speedups.get(m)
            cells.append("failed" if ms is None else f"{ms:.4f} ({sp:.2f}x)" if sp else f"{ms:.4f}")
        cells.append(f"±{w.noise_band:.1%}")
        rows.append(cells)
    totals = dict(weighted_totals(result))
    weighted = [w for w in result.workloads if w.weight > 0]

    def total(name: str) -> str:
        """The trace's total, and its speedup against eager timed side by side in the same
        worker (sum of weight x that worker's eager ms over sum of weight x ms)."""
        t = totals.get(name)
        if t is None or name == "eager":
            return "failed" if t is None else f"{t:.2f}"
        if name == "nightshift":
            side = sum(w.weight * w.eager_ms for w in weighted)
        else:
            sps = [w.baseline_speedups.get(name) for w in weighted]
            side = None if None in sps else sum(w.weight * w.baselines[name] * sp for w, sp in zip(weighted, sps))
        return f"{t:.2f}" + (f" ({side / t:.2f}x)" if side and t else "")
    rows.append([f"TRACE {Path(trace).name} (sum weight x ms)", "", total("eager"), total("nightshift"),
                 *(total(m) for m in modes), f"±{(result.noise_band or 0):.1%}"])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(wd) if i == 0 else c.rjust(wd) for i, (c, wd) in enumerate(zip(r, widths)))
    lines = [f"{result.device_name or result.device} ({'CPU timings, not GPU numbers' if result.timing_kind == 'cpu' else 'GPU timings'}); "
             f"speedups against eager in the same worker", fmt(head), fmt(["-" * wd for wd in widths])]
    lines += [fmt(r) for r in rows]
    lines += [f"applied: {a.region} {a.candidate_hash} ({a.template or a.planner}, {a.region_speedup:.2f}x alone)"
              for a in result.accepted]
    lines += [f"dropped: {d.region} {d.candidate_hash}: {d.reason[:120]}" for d in result.dropped]
    lines += [f"baseline {k} failed: {v[:160]}" for k, v in result.baseline_errors.items()]
    lines += [f"note: {n}" for n in result.notes]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--trace", default=str(ROOT / "examples" / "traces" / "agent.jsonl"))
    ap.add_argument("--gpu-hours", type=float, default=0.03, help="Tuning budget (device time over all devices).")
    ap.add_argument("--max-candidates", type=int, default=60)
    ap.add_argument("--patience", type=int, default=20)
    ap.add_argument("--regions", default="LlamaAttention,LlamaMLP", help="Classes to tune ('' : by the profile).")
    ap.add_argument("--modes", default="torch.compile,max-autotune-no-cudagraphs,reduce-overhead")
    ap.add_argument("--model-workloads", action=argparse.BooleanOptionalAction, default=True,
                    help="Also time the model's own KV-cache workloads (weight 0).")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--compile-s", type=float, default=150.0,
                    help="Integration's limit on one candidate's compile (a torch.compile mode past it: failed, timeout).")
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    from agent.review.integrate import BASELINES, integrate
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in BASELINES]
    if unknown:
        sys.exit(f"--modes: unknown {', '.join(unknown)} (known: {', '.join(BASELINES)})")
    t0 = time.time()
    print(f"[{time.strftime('%H:%M:%S')}] tune on {args.trace} ({args.gpu_hours} device-hours)", flush=True)
    run = tune(args.out_dir, args)
    print(f"[{time.strftime('%H:%M:%S')}] integrate {run} ({time.time() - t0:.0f}s so far)", flush=True)
    from sandbox.runner import Limits
    result = integrate(run, None if args.device == "auto" else args.device, baselines=bool(modes), modes=modes,
                       limits=Limits(compile_s=args.compile_s, run_s=600, time_s=300),
                       on_note=lambda n: print(f"  note: {n}", flush=True),
                       on_step=lambda line: print(f"  [{time.strftime('%H:%M:%S')}] {line}", flush=True))
    lines = table(result, args.trace)
    print("\n".join(lines))
    try:
        from agent.report import write
        from tools.runfolder import RunFolder
        print(f"report: {write(RunFolder.open(run))}")
    except Exception as e:  # the table above is the deliverable; the report is a convenience
        print(f"(report not written: {type(e).__name__}: {e})")
    (args.out_dir / "traffic.json").write_text(json.dumps(
        {"run": str(run), "trace": args.trace, "wall_s": time.time() - t0, "table": lines,
         "integration": result.model_dump(mode="json")}, indent=2))
    print(f"[{time.strftime('%H:%M:%S')}] done in {time.time() - t0:.0f}s; {args.out_dir / 'traffic.json'}")


if __name__ == "__main__":
    main()
