"""Every trial of run folders, with each workload's timing and noise band (for reading a GPU
run's numbers where the report only shows the best).

    python bench/dump_trials.py FOLDER...   (run folders, or folders holding runs/*)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.store import Store  # noqa: E402

for arg in sys.argv[1:]:
    root = Path(arg)
    for path in sorted([root / "trials.sqlite"] if (root / "trials.sqlite").exists() else root.rglob("trials.sqlite")):
        print(path)
        trials = list(Store(path, readonly=True).trials())
        t0 = min((t.started_at for t in trials), default=0.0)
        for t in trials:
            band = "-" if t.noise_band is None else f"{t.noise_band:.3f}"
            print(f"  {t.region} {t.candidate_hash} {t.generation} {t.status.value} speedup {t.speedup} band {band}"
                  f" {(t.reason or '')[:160]}")
            if t.phases:  # when it ran (s after the store's first trial) and where its seconds went
                print(f"    at {t.started_at - t0:.1f}-{t.finished_at - t0:.1f} s: "
                      + " ".join(f"{k}={v:.2f}" for k, v in t.phases.items()))
            for w in t.timings or []:
                print(f"    {w.workload}: original {w.baseline_ms:.4f} candidate {w.candidate_ms:.4f} ms "
                      f"({w.speedup:.2f}x) band {w.noise_band:.3f} original's rounds "
                      f"{[round(x, 4) for x in w.baseline_runs]}, "
                      f"candidate's {[round(x, 4) for x in w.candidate_runs]}, "
                      f"controls {[round(x, 3) for x in w.controls]}; parent {w.parent_ms}; band from {w.band_parts()}")
