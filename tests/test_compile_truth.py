"""torch.compile measured as its users get it: a compiled candidate, and the compile baseline of
integration, time like a standalone torch.compile of the same model, and a compiled way that
runs eager is labelled so.

The model (tests/models/pointwise_chain.py) is a chain that Inductor fuses into one loop. A
frame dynamo skips runs eager for good afterwards; verification once ran every candidate's
call inside a Python dispatch mode, which does exactly that, and compile read 1.0x here."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests" / "models" / "pointwise_chain.py"
COMPILED = '''import torch
_compiled = {}


def forward(module, *args):
    if id(module) not in _compiled:
        _compiled[id(module)] = torch.compile(module)
    return _compiled[id(module)](*args)
'''
SKIPPED = '''import torch
from torch.utils._python_dispatch import TorchDispatchMode
_compiled = {}


class _Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def forward(module, *args):
    if id(module) not in _compiled:
        _compiled[id(module)] = torch.compile(module)
        with _Mode():  # dynamo skips this frame under a dispatch mode, and from then on for good
            _compiled[id(module)](*args)
    return _compiled[id(module)](*args)
'''
# The standalone measurement: one thread like the sandbox's CPU workers, eager and compiled
# interleaved after warm-up (a burst of load on the machine then slows both alike), median of 21,
# each pair on a new input as a user's batches come (the same input every call let eager's
# passes hit the cache, and its speedup moved between 4x and 6.5x from run to run).
STANDALONE = f'''
import sys, time, torch
sys.path.insert(0, {str(MODEL.parent)!r})
import pointwise_chain as m
torch.set_num_threads(1)
model, x0 = m.Model(), m.get_inputs()[0]
compiled = torch.compile(model)
def timed(f, x):
    t = time.perf_counter(); f(x); return time.perf_counter() - t
with torch.no_grad():
    for _ in range(3):
        model(x0), compiled(x0)
    pairs = []
    for i in range(21):
        x = x0 * (1 + 1e-3 * i)
        pairs.append((timed(model, x), timed(compiled, x)))
    print(sorted(e for e, _ in pairs)[10] / sorted(c for _, c in pairs)[10])
'''


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from agent.setup.jobs import profile_and_freeze
    tmp = tmp_path_factory.mktemp("compile_truth")
    return profile_and_freeze(MODEL, "cpu", None, tmp / "runs", regions=["Model"]).run


def _standalone() -> float:
    out = subprocess.run([sys.executable, "-c", STANDALONE], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.strip().splitlines()[-1])


def _try(run, source: str, do_time: bool = True):
    from sandbox.runner import TrialRunner
    from tools.trial import Candidate
    runner = TrialRunner("cpu")
    try:
        runner.add_problem(run.problems_dir / "Model")
        return runner.run(Candidate(region="Model", source=source, planner="manual"), do_time=do_time)
    finally:
        runner.close()


@pytest.mark.alone
def test_a_compiled_candidate_and_the_compile_baseline_time_like_standalone_compile(run):
    from agent.review.early_baselines import EarlyBaselines
    from agent.review.integrate import integrate
    standalone = _standalone()
    assert standalone > 1.8, f"standalone torch.compile is only {standalone:.2f}x here: the model proves nothing"
    trial = _try(run, COMPILED)
    assert trial.status.value == "ok", trial.reason
    assert not trial.compile_fallback, trial.compile_fallback
    assert trial.dynamo["regions"] == [1] and trial.dynamo["graphs"] >= 1
    # The baseline as a tune gets it: compiled, verified and timed beside the search (which is
    # the compiled candidate's trial here), then only picked up by integration.
    early_steps, steps = [], []
    early = EarlyBaselines(run, "cpu", modes=["torch.compile"], on_step=early_steps.append).start()
    result = integrate(run.path, "cpu", baselines=True, modes=["torch.compile"], cuda_graphs=False,
                       early=early, on_step=steps.append)
    early.close()
    assert any(s.startswith("torch.compile: ok") for s in early_steps), early_steps
    assert not any("torch.compile" in s for s in steps), steps  # not compiled or timed again
    baseline = result.workloads[0].baseline_speedups["torch.compile"]
    assert result.baseline_fallbacks == {}, result.baseline_fallbacks
    # At least 60% of what the compiler gives standalone (on the old code both read about 1.0x).
    # Standalone is measured again after: this VM's speed drifts over a minute (standalone read
    # 3.2x to 6.2x and the harness 2.9x to 5.5x in four runs back to back, old code and new
    # alike), so the harness is held to the lower of the two readings around it.
    # The second reading may land low (1.74x once on CI): held to 60% of that, the harness must
    # still read 1.3x or more, well clear of eager's 1.0x, which is what the old code read.
    standalone = min(standalone, _standalone())
    floor = max(0.6 * standalone, 1.3)
    assert trial.speedup >= floor, (trial.speedup, standalone)
    assert baseline >= floor, (baseline, standalone)


def test_baselines_that_could_not_run_beside_the_search_are_run_by_integration(run):
    from agent.review.early_baselines import EarlyBaselines
    from agent.review.integrate import integrate
    from agent.review.early_baselines import BASELINE_NICE
    early = EarlyBaselines(run, "cpu", modes=["torch.compile"])
    # beside a search they compile at a lower priority, both sides of their timings alike
    assert early.pool.nice == early.pool.reference.config.nice == BASELINE_NICE > 0
    early.close()  # never started (a search interrupted at once): nothing to pick up
    steps = []
    result = integrate(run.path, "cpu", baselines=True, modes=["torch.compile"], cuda_graphs=False,
                       early=early, on_step=steps.append)
    assert any(s.startswith("torch.compile: ok") for s in steps), steps
    assert result.workloads[0].baselines["torch.compile"] is not None
    # The modes left out are named, so the report's "fastest way" is read as among those compared.
    assert any(n.startswith("not compared against max-autotune-no-cudagraphs, reduce-overhead (--compile-modes)")
               for n in result.notes), result.notes


def test_only_candidates_that_compile_are_probed_in_a_worker_where_dynamo_is_loaded(run):
    """dynamo stays loaded in a worker after a compiled candidate; a Triton or plain candidate
    after it is not "torch.compile fell back to eager" (the label once sat on the H200's split-KV
    decode kernel), while a skipped compile after it still is, and says so in its flags. The probe
    runs for every passing trial, timed or not. (dynamo's eager backend: what is probed is
    dynamo's, and Inductor's C++ compile of the first would cost the CPU 9 s.)"""
    from sandbox.runner import TrialRunner
    from tools.trial import Candidate
    plain = "def forward(module, *args):\n    return type(module).forward(module, *args)\n"
    compiled = COMPILED.replace("torch.compile(module)", 'torch.compile(module, backend="eager")')
    runner = TrialRunner("cpu")
    try:
        runner.add_problem(run.problems_dir / "Model")
        first, second, third = (runner.run(Candidate(region="Model", source=s, planner="manual"), do_time=False)
                                for s in (compiled, plain, SKIPPED))
    finally:
        runner.close()
    assert [t.status.value for t in (first, second, third)] == ["ok"] * 3
    assert first.dynamo["graphs"] >= 1 and not first.compile_fallback
    assert second.dynamo is None and not any("torch.compile" in f for f in second.flags), second.flags
    assert third.compile_fallback.startswith("fell back to eager"), third.dynamo
    assert third.dynamo["regions"] == [0]
    assert any("torch.compile fell back to eager" in f for f in third.flags), third.flags


def test_a_call_that_ran_no_op_at_all_is_not_called_a_fallback():
    """A CUDA graph's replay runs no Python: the probe sees no compiled region and no op run eager
    (integration's graphed way, whose routed regions use torch.compile, read "torch.compile fell
    back to eager" on the H100 on 2026-12-06). What ran eager is still named."""
    from tools.trial import compile_fallback
    assert compile_fallback({"regions": [0, 0], "eager_ops": [0, 0]}) == ""
    assert compile_fallback({"regions": [0, 0], "eager_ops": [0, 31]}).startswith("fell back to eager")
    assert compile_fallback({"regions": [1, 0], "eager_ops": [0, 31]}) == "fell back to eager on input set 1"


LATER_COMPILE = '''import time
import torch
_calls = {}


def forward(module, *args):
    """Eager on its first call, compiled from the second on (as a routed model compiled after one
    eager call is, and as reduce-overhead records its CUDA graphs); the compile's cost is the sleep."""
    n = _calls[id(module)] = _calls.get(id(module), 0) + 1
    if n == 1:
        return type(module).forward(module, *args)
    if n == 2:
        time.sleep(2.0)
        _calls["compiled"] = torch.compile(type(module).forward, backend="eager")
    return _calls["compiled"](module, *args)
'''


def test_a_compile_on_the_second_call_is_paid_in_load_not_under_the_device_lock(run):
    trial = _try(run, LATER_COMPILE, do_time=False)
    assert trial.status.value == "ok", trial.reason
    assert trial.phases["load"] >= 2.0, trial.phases
    assert trial.phases["verify"] < 1.5, trial.phases  # verification and timing hold the device lock


def test_the_truth_table_gives_each_compile_mode_its_own_band_not_the_tuned_models(monkeypatch):
    """A tuned model timed noisily (±23% on the H100, 2026-12-06) once widened every compile
    mode's band to its own, so rows whose modes were timed to ±0.8% read "agree" with anything."""
    from types import SimpleNamespace
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from compile_truth import _agree, harness_from
    w = SimpleNamespace(name="prefill", noise_band=0.23, eager_ms=3.88,
                        baseline_speedups={"torch.compile": 1.39, "reduce-overhead": 1.38},
                        baselines={"torch.compile": 2.80, "reduce-overhead": 2.81},
                        baseline_bands={"reduce-overhead": 0.008})
    got = harness_from(SimpleNamespace(workloads=[w], baseline_fallbacks={}, dynamo={}))
    assert got["reduce-overhead"]["prefill"]["band"] == 0.008
    assert got["torch.compile"]["prefill"]["band"] == 0.23  # no band of its own recorded: the tuned model's
    script = {"speedup": 1.26, "band": 0.007}
    assert _agree(got["reduce-overhead"]["prefill"], script) is False


def test_the_dynamo_probe_names_the_graph_each_call_ran():
    """A shape seen after others may run a dynamic graph compiled for another one (the example's
    prefill ran long prefill's on the CPU, 2026-12-06): the probe says which graph each call ran,
    and an eager call none."""
    import torch

    from sandbox import compiled
    torch._dynamo.reset()
    f = torch.compile(lambda x: (x.sin() + 1).cos())
    for n in (8, 16, 32):
        f(torch.randn(n))
    got = compiled.probe([lambda n=n: f(torch.randn(n)) for n in (8, 16, 32)] + [lambda: torch.randn(4).sin()], {})
    ran = got["graphs_run"]
    assert len(ran) == 4 and ran[3] == []
    assert all(len(r) == 1 and r[0].count("/") == 1 for r in ran[:3]), ran
    assert got["graphs"] >= len({r[0] for r in ran[:3]})
