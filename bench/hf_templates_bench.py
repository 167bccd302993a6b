"""Every kernel template that binds a transformers model's regions, each verified and (on a GPU)
timed side by side with the original region on the model's own workloads, in one table.

    python bench/hf_templates_bench.py tests/problems/hf_llama.py [--regions A,B] [--out DIR]

Before a tune, this says which templates bind the served model (attention over its cache, the
decode GEMVs, ...), whether each passes the verifier there, and per workload what it reads against
the region as transformers runs it. Default regions: the model's attention, MLP and decoder layer
classes. Each template runs at its default point; cache_attention also on its SDPA path. On a
machine without CUDA only verdicts are printed: CPU timings are not GPU timings.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from agent.planners.library import applicable, default_params, render  # noqa: E402
from sandbox.runner import TrialRunner  # noqa: E402
from tools.capture import RegionChoice, freeze  # noqa: E402
from tools.modelfile import load_model  # noqa: E402
from tools.trial import Candidate, Status  # noqa: E402

EXTRA_POINTS = {"cache_attention": [{"path": "sdpa"}]}
"""Points tried besides the default, per template."""
SUFFIXES = ("Attention", "MLP", "DecoderLayer")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--regions", help="comma-separated module classes (default: attention, MLP, decoder layer)")
    ap.add_argument("--out", help="where the problems are frozen (default: a temporary folder)")
    ap.add_argument("--per-region", type=int, default=4, help="bindings tried per template and region")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = load_model(args.model, device)
    classes = args.regions.split(",") if args.regions else sorted(
        {type(m).__name__ for m in loaded.model.modules() if type(m).__name__.endswith(SUFFIXES)})
    base = Path(args.out or tempfile.mkdtemp(prefix="hf-templates-"))
    frozen = []
    for cls in classes:  # one at a time: a decoder layer holds the attention and MLP regions
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            problems, skipped = freeze(loaded, [RegionChoice(cls)], base / cls, torch.device(device))
        frozen += [(base / cls / p.name, p) for p in problems]
        for s in skipped:
            print(f"not frozen: {s.class_name}: {s.reason}")
    runner = TrialRunner(device)
    rows = []
    try:
        for folder, p in frozen:
            runner.add_problem(folder)
            seen: dict[str, int] = {}
            for template, binding in applicable(p):
                seen[template.name] = seen.get(template.name, 0) + 1
                if seen[template.name] > args.per_region:
                    continue
                for extra in [{}] + EXTRA_POINTS.get(template.name, []):
                    params = {**default_params(template), **extra}
                    source = render(template, binding, params)
                    trial = runner.run(Candidate(region=p.name, source=source, planner="template",
                                                 template=template.name, params=params), do_time=device != "cpu")
                    rows.append((p.name, template.name, extra, trial))
                    print(_row(*rows[-1]), flush=True)
    finally:
        runner.close()
    print(f"\n{device}: {torch.cuda.get_device_name() if device == 'cuda' else 'CPU (verdicts only)'}")
    print("| region | template | point | status | per workload: candidate/original ms (speedup, band) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(_row(*r))
    return 0 if any(t.status is Status.ok for *_, t in rows) else 1


def _row(region: str, template: str, extra: dict, trial) -> str:
    point = ",".join(f"{k}={v}" for k, v in extra.items()) or "default"
    if trial.status is not Status.ok:
        return f"| {region} | {template} | {point} | {trial.status.value} | {trial.reason[:120]} |"
    times = "; ".join(f"{t.workload} {t.candidate_ms:.3f}/{t.baseline_ms:.3f} ({t.speedup:.2f}x, ±{t.noise_band:.1%})"
                      for t in trial.timings) or "not timed"
    return f"| {region} | {template} | {point} | ok | {times} |"


if __name__ == "__main__":
    sys.exit(main())
