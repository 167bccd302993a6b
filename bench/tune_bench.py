"""The search loop's own efficiency on a GPU (issue 4), from a real `agent tune` run.

    python bench/tune_bench.py OUT_DIR [GPU_HOURS] [extra agent tune flags...]

Runs `agent tune --model examples/llama.py` with the template planner, then reads the run's
store: per region the best speedup (GPU timings, side by side in one worker) and the trial
that found it, trials per GPU-hour, and the share of the search's wall time the GPU spent
verifying or timing (compile and import time excluded).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "bench-out")
hours = sys.argv[2] if len(sys.argv) > 2 else "0.05"
extra = sys.argv[3:]
out_dir.mkdir(parents=True, exist_ok=True)
t0 = time.time()
proc = subprocess.run([sys.executable, "-m", "agent", "tune", "--model", "examples/llama.py", "--gpu-hours", hours,
                       "--max-candidates", "400", "--runs-dir", str(out_dir / "runs"), "--json", *extra],
                      cwd=ROOT, capture_output=True, text=True)
wall = time.time() - t0
(out_dir / "tune.stdout").write_text(proc.stdout)
(out_dir / "tune.stderr").write_text(proc.stderr)
if proc.returncode != 0:
    print(proc.stderr[-3000:])
    sys.exit(proc.returncode)
summary = json.loads(proc.stdout)

from tools.runfolder import RunFolder  # noqa: E402

run = RunFolder.open(Path(summary["run"]))
trials = list(run.store(readonly=True).trials())
start = min(t.started_at for t in trials)
end = max(t.finished_at for t in trials)
search_wall = end - start
busy = sum(t.phases.get("verify", 0) + t.phases.get("time", 0) for t in trials)
held = sum(t.gpu_seconds for t in trials)  # charged device time (union over the device's workers)
print(f"agent tune: {wall:.0f} s in all, search {search_wall:.0f} s, {len(trials)} trials, "
      f"stop: {summary['stop_reason']}")
print(f"trials per GPU-hour (search wall): {len(trials) / (search_wall / 3600):.0f}; "
      f"GPU busy verifying or timing: {busy / search_wall:.0%} of the search's wall time "
      f"(GPU-hours charged: {held / 3600:.4f} of {hours} cap)")
print(f"{'region':<16} {'trials':>6} {'ok':>4} {'best':>7} {'found at':>8} {'error':>9} {'tol':>12}  template / per-workload")
for p in run.problems():
    ts = [t for t in trials if t.region == p.name]
    ok = [t for t in ts if t.ranked]
    if not ok:
        print(f"{p.name:<16} {len(ts):>6} {0:>4} {'-':>7}")
        continue
    best = max(ok, key=lambda t: t.speedup)
    at = ts.index(best) + 1
    per = ", ".join(f"{x.workload} {x.baseline_ms:.4f}->{x.candidate_ms:.4f} ms" for x in best.timings)
    print(f"{p.name:<16} {len(ts):>6} {len(ok):>4} {best.speedup:>6.2f}x {at:>8} {best.error:>9.2g} "
          f"{str(p.tolerance):>12}  {best.template} {best.params.get('tune')} | {per}")
    by_template: dict[str, float] = {}
    for t in ok:
        by_template[t.template or "?"] = max(by_template.get(t.template or "?", 0), t.speedup)
    print(f"{'':<16} best per template: {by_template}")
fails: dict[str, int] = {}
for t in trials:
    if t.status.value != "ok":
        fails[t.status.value] = fails.get(t.status.value, 0) + 1
print(f"rejected: {fails}")
for status in fails:
    t = next(t for t in trials if t.status.value == status)
    print(f"  e.g. {status}: {t.region} {t.template}: {t.reason[:150]}")
