"""No false positives: a region's own forward, plain-torch rewrites of it, and the
whole model's own forward must all be `ok`, with timing on.

    python bench/honest_bench.py [--cpu] [--tiny] [--only=Conv2d,LayerNorm]

Cases: tests/models' tiny files (host-bound on a GPU, where the tuner's clock is hardest to
satisfy) and, without --tiny, two problems of the KernelBench-style set at full size. Also
called by bench/adversarial_bench.py. Prints one row per trial.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

FULL_SIZE = [("../problems/l2_gemm_scale_relu.py", "Linear"), ("../problems/l1_layernorm.py", "LayerNorm")]


def honest_rows(work: Path, device: str, limits, tiny: bool = False, only: list[str] | None = None,
                show=print) -> list[tuple]:
    import torch
    from sandbox.runner import TrialRunner
    from test_verdicts import CASES, MODELS, OWN, REWRITES
    from tools.capture import RegionChoice, freeze
    from tools.capture_model import freeze_model
    from tools.modelfile import load_model
    from tools.trial import Candidate

    rows = []
    dev = torch.device("cpu" if device == "cpu" else "cuda")
    for model_file, cls in [*CASES, *([] if tiny else FULL_SIZE)]:
        if only and cls not in only:
            continue
        folder = work / "honest" / Path(model_file).stem / cls
        loaded = load_model(MODELS / model_file, dev.type)
        probs, _ = freeze(loaded, [RegionChoice(cls)], folder / "problems", dev)
        freeze_model(loaded, folder / "model", dev)
        runner = TrialRunner(device, limits)
        try:
            runner.add_problem(folder / "problems" / probs[0].name)
            runner.add_problem(folder / "model")
            jobs = [(probs[0].name, f"rewrite {i}" if i else "own forward", src)
                    for i, src in enumerate([OWN, *REWRITES[cls]])] + [("model", "whole model, own forward", OWN)]
            for region, what, src in jobs:
                t = runner.run(Candidate(region=region, source=src))
                rows.append((Path(model_file).stem, cls, what, t.status.value, t.reason[:80],
                             t.speedup and round(t.speedup, 3), t.noise_band and round(t.noise_band, 4),
                             "; ".join(t.flags)[:60]))
                show(f"honest: {rows[-1]}")
        finally:
            runner.close()
    return rows


if __name__ == "__main__":
    from sandbox.runner import Limits
    cpu = "--cpu" in sys.argv
    only = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--only=")), None)
    rows = honest_rows(Path(tempfile.mkdtemp(prefix="nightshift-honest-")), "cpu" if cpu else "cuda:0",
                       Limits(compile_s=120, run_s=60, time_s=120, budget_ms=150), tiny="--tiny" in sys.argv,
                       only=only)
    refused = [r for r in rows if r[3] != "ok"]
    print(f"{len(rows) - len(refused)}/{len(rows)} honest trials ok; refused: {refused or 'none'}")
    sys.exit(1 if refused else 0)
