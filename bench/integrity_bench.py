"""The integrity check against torch.compile on this torch: candidate
workers start without torch._dynamo, so a candidate's torch.compile is the first to import it;
the wrappers that import installs must pass, and lookalikes of them must not.

    python bench/integrity_bench.py [--cpu]

Freezes tests/models/layernorm_gelu.py's LayerNorm on the device and runs, without timing:
the region's own forward, the same compiled with torch.compile (inductor, and backend eager),
and the adversarial candidates that dress their own code as torch's wrapper. Prints one row
per candidate and exits 1 if any status differs from what it should be.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    import torch
    from sandbox.runner import Limits, TrialRunner
    from test_verdicts import COMPILED, MODELS, OWN
    from tools.capture import RegionChoice, freeze
    from tools.modelfile import load_model
    from tools.trial import Candidate

    cpu = "--cpu" in sys.argv or not torch.cuda.is_available()
    dev = torch.device("cpu" if cpu else "cuda")
    work = Path(tempfile.mkdtemp(prefix="nightshift-integrity-"))
    loaded = load_model(MODELS / "layernorm_gelu.py", dev.type)
    probs, _ = freeze(loaded, [RegionChoice("LayerNorm")], work / "problems", dev)
    adversarial = ROOT / "tests" / "candidates" / "adversarial"
    cases = [("own forward", OWN, "ok"),
             ("torch.compile (inductor)", COMPILED.replace(', backend="eager"', ""), "ok"),
             ("torch.compile (eager backend)", COMPILED, "ok"),
             *[(f.stem, f.read_text(), "suspicious") for f in
               (adversarial / "forges_torch_wrapper.py", adversarial / "wraps_original_in_torch_clothes.py",
                adversarial / "patches_torch.py")]]
    runner = TrialRunner("cpu" if cpu else "cuda:0", Limits(compile_s=300, run_s=120))
    wrong = []
    try:
        runner.add_problem(work / "problems" / probs[0].name)
        for what, source, want in cases:
            t0 = time.time()
            trial = runner.run(Candidate(region=probs[0].name, source=source), do_time=False)
            ok = trial.status.value == want
            wrong += [] if ok else [what]
            print(f"{what:34s} want {want:10s} got {trial.status.value:10s} {'yes' if ok else 'NO '} "
                  f"{time.time() - t0:5.1f} s  {trial.reason[:90]}", flush=True)
    finally:
        runner.close()
    print(f"torch {torch.__version__} on {dev}: {len(cases) - len(wrong)}/{len(cases)} as they should be"
          + (f"; wrong: {wrong}" if wrong else ""))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
