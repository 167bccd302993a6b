"""Issue 49's numbers from finished `agent tune` runs: the search's rate, its first trial, its
integration, its best region speedups and what its screen did; with two runs (the screen on, then
`--no-screen`), the best region speedups side by side. With `--cap H`, whether each run ended
within 5% of an H GPU-hour cap.

    python bench/screen_compare.py RUN [RUN ...] [--cap 0.01]

Per run, from its store and log.txt:
- trials that ended with a verdict (screened ones included), the device hours charged to them,
  and trials per device-hour;
- the first trial: seconds from the log's `session start` line to the first trial's end;
- integration: seconds from the log's `integrating:` line to its last line (the report written);
- per region, the best kept candidate's speedup and band (what integration starts from);
- the screen: candidates screened out, those it would have dropped that were timed in full as a
  check (a tenth, drawn by the tuner), and how many of those beat the best they were screened
  against: its measured misses.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def read(run: Path) -> dict:
    from agent.history import History
    from tools import screen
    from tools.runfolder import RunFolder
    folder = RunFolder.open(run)
    problems = folder.problems()
    history = History({p.name: p.target_generations for p in problems})
    store = folder.store(readonly=True)
    try:
        for t in store.trials():
            history.add(t)
    finally:
        store.close()
    trials = history.trials
    hours = sum(t.gpu_seconds for t in trials) / 3600
    log = (folder.path / "log.txt").read_text().splitlines() if (folder.path / "log.txt").is_file() else []
    stamp = lambda line: time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S"))  # noqa: E731
    start = next((stamp(x) for x in log if " session start:" in x), None)
    first = min((t.finished_at for t in trials), default=None)
    integrating = next((stamp(x) for x in log if " integrating:" in x), None)
    best = {}
    for p in problems:
        rec = history.best(p.name)
        if rec is not None:
            t = next(iter(rec.by_generation.values()))
            best[p.name] = (rec.score(history.targets(p.name)), t.noise_band or 0.0)
    counts: dict[str, int] = {}
    for t in trials:
        counts[t.status.value] = counts.get(t.status.value, 0) + 1
    return {"run": folder.path, "trials": len(trials), "hours": hours, "rate": len(trials) / hours if hours else 0.0,
            "first_s": (first - start) if first and start else None,
            "integration_s": (stamp(log[-1]) - integrating) if integrating and log else None,
            "best": best, "counts": counts, "screen": screen.misses(trials), "summary": screen.summary(trials)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--cap", type=float, default=None, help="the runs' --gpu-hours: report the overrun")
    args = ap.parse_args(argv)
    rows = [read(r) for r in args.runs]
    bad = False
    for r in rows:
        first = f"{r['first_s']:.0f} s" if r["first_s"] is not None else "-"
        integ = f"{r['integration_s']:.0f} s" if r["integration_s"] is not None else "not run"
        print(f"\n{r['run'].name}: {r['trials']} trials in {r['hours']:.4f} device-hours = {r['rate']:.0f} trials per "
              f"device-hour; first trial {first} after the session's start; integration {integ}")
        print("  statuses: " + ", ".join(f"{k} {v}" for k, v in sorted(r["counts"].items())))
        dropped, audited, missed = r["screen"]
        print(f"  screen: {dropped} screened out, {audited} audited in full, {missed} of those beat their best"
              + (f" (miss rate {missed / audited:.0%})" if audited else ""))
        for region, (speedup, band) in sorted(r["best"].items()):
            print(f"  best {region}: {speedup:.3f}x (band ±{band:.1%})")
        if args.cap is not None:
            over = r["hours"] / args.cap - 1
            bad |= over > 0.05
            print(f"  cap: {r['hours']:.4f} of {args.cap:g} h ({over:+.1%}: {'within' if over <= 0.05 else 'PAST'} 5%)")
    if len(rows) == 2:
        a, b = rows
        print(f"\nbest region speedups, {a['run'].name} against {b['run'].name}:")
        for region in sorted(set(a["best"]) | set(b["best"])):
            sa, sb = a["best"].get(region, (0.0, 0.0)), b["best"].get(region, (0.0, 0.0))
            tie = sa[0] * (1 + sa[1]) >= sb[0] / (1 + sb[1])  # within the two bands counts as at least as good
            print(f"  {region}: {sa[0]:.3f}x against {sb[0]:.3f}x: {'at least as good' if tie else 'WORSE'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
