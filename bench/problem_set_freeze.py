"""Profile and freeze model files on one device, then judge candidates for every frozen region
in one sandbox worker: the region's own forward, a nudged copy of it (must be rejected), and
the first template candidates. One JSON line per model file and per trial.

    python bench/problem_set_freeze.py tests/problems/*.py --device cuda --templates 2 --time

For the GPU: the problem set's full sizes (the default with CUDA), transformers models at
8B layer sizes in bf16. Nothing here is a benchmark of speed unless --time is given, and
then only region speedups side by side in one worker.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.planners.library import applicable, default_params, render  # noqa: E402
from sandbox.runner import TrialRunner  # noqa: E402
from tools.capture import RegionChoice, freeze  # noqa: E402
from tools.devices import get_ceilings  # noqa: E402
from tools.modelfile import load_model  # noqa: E402
from tools.profiler import plan_regions, profile_model  # noqa: E402
from tools.trial import Candidate  # noqa: E402

IDENTITY = "def forward(module, *args, **kwargs):\n    return type(module).forward(module, *args, **kwargs)\n"
NUDGED = ("import torch\n\ndef _n(o):\n    if isinstance(o, torch.Tensor) and o.is_floating_point():\n"
          "        return o + 0.01 * (1 + o.abs())\n    return type(o)(_n(v) for v in o) if isinstance(o, (tuple, list)) else o\n\n"
          "def forward(module, *args, **kwargs):\n    return _n(type(module).forward(module, *args, **kwargs))\n")


def emit(**row) -> None:
    print(json.dumps(row, default=str), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--templates", type=int, default=0, help="template candidates to try per region")
    ap.add_argument("--time", action="store_true", help="time the passing candidates against the region")
    ap.add_argument("--folder", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    folder = args.folder or Path(tempfile.mkdtemp()) / "problems"
    ceilings = get_ceilings(dev)
    frozen = []
    for path in args.models:
        t0 = time.monotonic()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loaded = load_model(path, dev)
                result = profile_model(loaded, dev, None, ceilings)
                verdicts = plan_regions(result)
                choices = [RegionChoice(v.class_name, v.share) for v in verdicts if v.chosen]
                problems, skipped = freeze(loaded, choices, folder, dev, ceilings=ceilings.model_dump(),
                                           device_name=result.device_name)
        except Exception as e:  # one model file's failure is its row, not the run's end
            emit(model=path.stem, error=f"{type(e).__name__}: {e}"[:600])
            continue
        emit(model=path.stem, seconds=round(time.monotonic() - t0, 1), total_ms=round(result.total_ms, 4),
             coverage=round(sum(p.share_of_model for p in problems), 3), notes=result.notes,
             regions=[{"name": p.name, "path": p.region_path, "share": round(p.share_of_model, 3),
                       "notes": p.notes, "templates": sorted({t.name for t, _ in applicable(p)})} for p in problems],
             skipped={s.class_name: s.reason for s in skipped})
        frozen += problems
        del loaded, result
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    runner = TrialRunner(str(dev) if dev.type == "cpu" else "cuda:0")
    for p in frozen:
        runner.add_problem(folder / p.name)
    try:
        for p in frozen:
            tries = [("identity", IDENTITY), ("nudged", NUDGED)]
            tries += [(t.name, render(t, b, default_params(t))) for t, b in applicable(p)[: args.templates]]
            for label, source in tries:
                trial = runner.run(Candidate(region=p.name, source=source, planner="bench", template=label),
                                   do_time=args.time and label != "nudged")
                emit(region=p.name, candidate=label, status=trial.status.value, reason=trial.reason[:200],
                     error=trial.error, speedup=trial.speedup, seconds=round(trial.gpu_seconds, 1))
    finally:
        runner.close()


if __name__ == "__main__":
    main()
