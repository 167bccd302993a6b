"""Honest work is never rejected, and parameters that happen to be ones and zeros are no loophole.

- The region's own forward and plain-torch rewrites pass on nn.Linear, nn.LayerNorm, nn.Conv2d
  and whole-Model regions (the harness imports what it uses before its integrity snapshot, and
  the wrappers a candidate's torch.compile installs on importing dynamo are torch's own).
- A randomly initialised LayerNorm has weight 1 and bias 0: a candidate that ignores either is
  right on the frozen and fresh inputs, and wrong with the perturbed parameters: `ignored_parameter`,
  with that error shown.
- An unchanged region timed against itself reads "no change" (inside its A/A noise band), and
  is never a win.
- Outputs holding infinities or NaN (masked logits) are timed like any other: the checksum that
  binds a timed run's outputs counts them as finite codes.
"""

from pathlib import Path

import pytest
import torch

from sandbox.runner import Limits, TrialRunner
from tools.capture import RegionChoice, freeze
from tools.capture_model import freeze_model
from tools.modelfile import load_model
from tools.trial import Candidate, Status

MODELS = Path(__file__).parent / "models"
OWN = "def forward(module, *args, **kwargs):\n    return type(module).forward(module, *args, **kwargs)\n"
REWRITES = {
    "Linear": ["import torch.nn.functional as F\n\ndef forward(module, x):\n    return F.linear(x, module.weight, module.bias)\n",
               "def forward(module, x):\n    return x @ module.weight.t() + module.bias\n"],
    "LayerNorm": [
        "import torch.nn.functional as F\n\ndef forward(module, x):\n"
        "    return F.layer_norm(x, module.normalized_shape, module.weight, module.bias, module.eps)\n",
        "import torch\n\ndef forward(module, x):\n    m = x.mean(-1, keepdim=True)\n"
        "    v = (x - m).pow(2).mean(-1, keepdim=True)\n"
        "    return (x - m) * torch.rsqrt(v + module.eps) * module.weight + module.bias\n"],
    "Conv2d": ["import torch.nn.functional as F\n\ndef forward(module, x):\n"
               "    return F.conv2d(x, module.weight, module.bias, module.stride, module.padding, module.dilation,"
               " module.groups)\n"],
}
IGNORES = {  # right while the LayerNorm's weight is 1 and its bias 0, and only then
    "weight": "import torch.nn.functional as F\n\ndef forward(module, x):\n"
              "    return F.layer_norm(x, module.normalized_shape, None, module.bias, module.eps)\n",
    "bias": "import torch.nn.functional as F\n\ndef forward(module, x):\n"
            "    return F.layer_norm(x, module.normalized_shape, module.weight, None, module.eps)\n",
}
CASES = [("tiny_mlp.py", "Linear"), ("layernorm_gelu.py", "LayerNorm"), ("conv_relu.py", "Conv2d")]


@pytest.fixture(scope="module")
def frozen(tmp_path_factory):
    """Each model's region and the whole model, frozen on the CPU."""
    out = {}
    for model_file, cls in CASES:
        run = tmp_path_factory.mktemp(cls)
        loaded = load_model(MODELS / model_file, "cpu")
        problems, skipped = freeze(loaded, [RegionChoice(cls)], run / "problems", torch.device("cpu"))
        assert not skipped, skipped
        freeze_model(loaded, run / "model", torch.device("cpu"))
        out[cls] = (run / "problems" / problems[0].name, run / "model")
    return out


@pytest.mark.parametrize("model_file,cls", CASES, ids=[c for _, c in CASES])
def test_own_forward_and_plain_rewrites_pass_on_torch_regions_and_the_whole_model(frozen, model_file, cls):
    region, whole = frozen[cls]
    runner = TrialRunner("cpu", Limits(compile_s=120, run_s=60))
    try:
        runner.add_problem(region)
        runner.add_problem(whole)
        for source in [OWN, *REWRITES[cls]]:
            trial = runner.run(Candidate(region=region.name, source=source), do_time=False)
            assert trial.status is Status.ok, (cls, trial.status, trial.reason, trial.error_text[-600:])
        trial = runner.run(Candidate(region="model", source=OWN), do_time=False)
        assert trial.status is Status.ok, ("whole model", trial.status, trial.reason, trial.error_text[-600:])
    finally:
        runner.close()


COMPILED = """import torch

_compiled = {}


def forward(module, *args, **kwargs):
    # torch.compile, as the compiler planner's candidates use it: dynamo is first imported here.
    fn = _compiled.setdefault(id(module), torch.compile(type(module).forward, backend="eager"))
    return fn(module, *args, **kwargs)
"""


def test_a_torch_compile_candidate_is_not_tampering(frozen):
    """The candidate's worker starts without torch._dynamo; a candidate's torch.compile imports
    it, and the wrappers that import installs (manual_seed, Module.__init__) are torch's own. Their
    lookalikes are adversarial candidates (forges_torch_wrapper, wraps_original_in_torch_clothes)."""
    region, _ = frozen["LayerNorm"]
    runner = TrialRunner("cpu", Limits(compile_s=120, run_s=60))
    try:
        runner.add_problem(region)
        trial = runner.run(Candidate(region=region.name, source=COMPILED), do_time=False)
        assert trial.status is Status.ok, (trial.status, trial.reason, trial.error_text[-600:])
        again = runner.run(Candidate(region=region.name, source=COMPILED + "\n# again, in the same worker\n"),
                           do_time=False)
        assert again.status is Status.ok, (again.status, again.reason)
    finally:
        runner.close()


@pytest.mark.parametrize("ignored", sorted(IGNORES))
def test_ignoring_a_parameter_that_is_one_or_zero_is_caught(frozen, ignored):
    region, _ = frozen["LayerNorm"]
    runner = TrialRunner("cpu", Limits(compile_s=120, run_s=60))
    try:
        runner.add_problem(region)
        trial = runner.run(Candidate(region=region.name, source=IGNORES[ignored]), do_time=False)
        # Its own verdict, and the error shown is the one that rejected it, never the frozen inputs' 0.0.
        assert trial.status is Status.ignored_parameter, (trial.status, trial.reason)
        assert "perturbed" in trial.reason and trial.error is not None and trial.error > 1e-4
        assert trial.max_abs == trial.error and f"error {trial.error:.3g} > tolerance" in trial.reason
    finally:
        runner.close()


WIDE_NORM = """import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(2048)

    def forward(self, x):
        return self.norm(x)


def get_init_inputs():
    return []


def get_inputs():
    return [torch.randn(128, 2048)]
"""


def _wide_norm_trial(tmp_path: Path, source: str, rounds: int):
    """One timed trial of `source` on WIDE_NORM's LayerNorm (about 0.1 ms a call on CI's machine)."""
    (tmp_path / "wide_norm.py").write_text(WIDE_NORM)
    loaded = load_model(tmp_path / "wide_norm.py", "cpu")
    problems, _ = freeze(loaded, [RegionChoice("LayerNorm")], tmp_path / "run" / "problems", torch.device("cpu"))
    runner = TrialRunner("cpu", Limits(budget_ms=100, max_reps=40, rounds=rounds))
    try:
        runner.add_problem(tmp_path / "run" / "problems" / problems[0].name)
        return runner.run(Candidate(region=problems[0].name, source=source))
    finally:
        runner.close()


@pytest.mark.alone
def test_an_unchanged_region_reads_no_change_and_is_never_a_win(tmp_path):
    """A region big enough (about a millisecond on one CPU thread) that calling its forward through
    a candidate costs nothing measurable: timed against itself, inside its A/A band."""
    # Five rounds: this 2-core VM's CPU has bursts of stolen time tens of milliseconds long, and
    # with three rounds one burst in a single round read 0.63x against a ±56% band (CI, once); with
    # five, 0.62x against ±33% (CI, 2026-12-06). A false "slower" is measured once more; a false
    # "faster", the verdict that would rank the region's own forward as a win, never is.
    readings = []
    for attempt in range(2):
        (tmp_path / str(attempt)).mkdir()
        trial = _wide_norm_trial(tmp_path / str(attempt), OWN, rounds=5)
        assert trial.status is Status.ok, trial.reason
        assert trial.noise_band is not None and trial.noise_band > 0
        assert all(t.noise_band > 0 and len(t.baseline_runs) >= 2 and t.parent_ms is not None for t in trial.timings)
        readings.append([(t.verdict, round(t.speedup, 3), round(t.noise_band, 3)) for t in trial.timings])
        assert not trial.win and all(t.verdict != "faster" for t in trial.timings), readings
        if [t.verdict for t in trial.timings] == ["no change"]:
            break
    assert [v for v, _, _ in readings[-1]] == ["no change"], readings


@pytest.mark.alone
def test_a_clearly_slower_candidate_is_timed_in_two_rounds_and_still_spot_checked(tmp_path):
    """A hundred times the original's work: its first two rounds read about 0.01x, so a third
    would only narrow the band around a loss; the trial says so, and its rounds were spot-checked."""
    # A hundred: the original's call is about 0.1 ms here, so a whole round of it takes well under
    # a millisecond and one scheduling hiccup on CI's two cores can slow all of it; at ten times
    # (and five before) a round read above 0.5x and a third ran. Now it would have to run 50x slower.
    slow = ("def forward(module, *args, **kwargs):\n    for _ in range(100):\n"
            "        out = type(module).forward(module, *args, **kwargs)\n    return out\n")
    trial = _wide_norm_trial(tmp_path, slow, rounds=3)
    assert trial.status is Status.ok, trial.reason
    assert [len(t.baseline_runs) for t in trial.timings] == [2] * len(trial.timings)
    assert trial.speedup < 0.5 and not trial.win
    assert any(f.startswith("timed in two rounds on ") for f in trial.flags), trial.flags
    assert "spot_judge" in trial.phases  # every workload's rounds were checked


def test_tune_with_cheats_among_good_candidates_keeps_only_the_good_ones(tmp_path):
    """`agent tune --planner files`, an inbox of one honest candidate and cheats of every kind
    the verdict defends against: the run completes, only the honest one is kept, and the report
    names it as the best."""
    import json
    import os
    import subprocess
    import sys

    from agent.setup.jobs import profile_and_freeze
    root = Path(__file__).resolve().parent.parent
    res = profile_and_freeze(MODELS / "tiny_rmsnorm.py", "cpu", None, tmp_path / "runs")
    inbox = res.run.inbox / "RMSNorm"
    inbox.mkdir(parents=True)
    honest = "import torch\n\ndef forward(module, x):\n    xf = x.float()\n" \
             "    return module.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.eps)).to(x.dtype)\n"
    (inbox / "honest.py").write_text(honest)
    cheats = ["timed_call_counter", "content_cache", "late_thread_write", "patches_timer", "forges_reply",
              "clone_override", "reuses_output_buffer"]
    for name in cheats:
        (inbox / f"{name}.py").write_text((root / "tests/candidates/adversarial" / f"{name}.py").read_text())
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-m", "agent", "tune", "--resume", str(res.run.path), "--planner", "files",
                           "--devices", "cpu", "--max-candidates", "20", "--no-integrate", "--json"],
                          capture_output=True, text=True, env=env, cwd=root, timeout=900)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    store = res.run.store()
    trials = {Path(t.candidate_path).name if t.candidate_path else t.candidate_hash: t for t in store.trials()}
    store.close()
    by_note = {}
    for t in trials.values():
        source = Path(t.candidate_path).read_text() if t.candidate_path else ""
        name = next((n for n in ["honest", *cheats] if source == (inbox / f"{n}.py").read_text()), "?")
        by_note[name] = t
    assert set(by_note) == {"honest", *cheats}, sorted(by_note)
    assert by_note["honest"].status is Status.ok, by_note["honest"].reason
    for name in cheats:
        assert by_note[name].status is not Status.ok, (name, by_note[name].reason)
    summary = json.loads(done.stdout)
    assert summary["trials"] == len(cheats) + 1
    report = (res.run.path / "report.md").read_text()
    assert by_note["honest"].candidate_hash in report
    for name in cheats:
        assert f"candidates/{by_note[name].candidate_hash}.py" not in report.split("## ")[0]


def test_a_cross_process_offset_is_inside_the_band_as_the_verdict_reads_it():
    """Measured on the H200 (A/A of the untouched example, small_batch, host-bound): the original
    ran 27% slower in the candidate's worker than in the reference worker (the control), and
    the 'candidate', the same code, came out at the same ratio. The band held the control in
    log units (0.24), the verdict reads 1 / (1 + band): it said "slower". The control counts as
    the verdict reads it, plus the ratio's own spread; a real 2x with a clean control is still
    faster."""
    from sandbox.timed import ab_band
    from tools.trial import verdict
    band = ab_band([2.30, 2.31, 2.29], [2.93, 2.92, 2.94], [1.272], "cuda")
    assert verdict(2.30 / 2.93, band) == "no change", band
    assert verdict(2.93 / 2.30, band) == "no change", band
    clean = ab_band([1.00, 1.01, 0.99], [0.50, 0.50, 0.51], [1.01], "cuda")
    assert clean < 0.1 and verdict(2.0, clean) == "faster", clean
    assert ab_band([1.0, 1.0], [1.0, 1.0], [], "cuda") < 0.05


def test_right_values_in_transposed_strides_are_refused_where_the_region_returns_row_major(frozen):
    """A parent that views the region's output (x.view(...)) raised on every call of an applied
    model whose winner returned the right values in column-major strides: where the original's
    output is dense row-major, the candidate's must be."""
    region, _ = frozen["LayerNorm"]
    flipped = OWN.replace("return type(module).forward(module, *args, **kwargs)",
                          "out = type(module).forward(module, *args, **kwargs)\n"
                          "    return out.transpose(-1, -2).contiguous().transpose(-1, -2)")
    runner = TrialRunner("cpu", Limits(compile_s=120, run_s=60))
    try:
        runner.add_problem(region)
        trial = runner.run(Candidate(region=region.name, source=flipped), do_time=False)
    finally:
        runner.close()
    assert trial.status is Status.shape and "row-major" in trial.reason, (trial.status, trial.reason)


def test_an_output_that_is_a_slice_is_no_shape_error_but_an_expanded_one_is(tmp_path):
    """transformers' GPT-J rotary embedding returns two halves of one row: strided views with
    gaps. Its own forward, and a rewrite returning dense copies, must pass; an output whose
    elements overlap (one row expanded) is refused where the region's own outputs do not."""
    loaded = load_model(MODELS / "sliced_outputs.py", "cpu")
    problems, skipped = freeze(loaded, [RegionChoice("SinCos")], tmp_path / "problems", torch.device("cpu"))
    assert not skipped, skipped
    dense = OWN.replace("return type(module).forward(module, *args, **kwargs)",
                        "return tuple(t.contiguous() for t in type(module).forward(module, *args, **kwargs))")
    # Right wherever every sequence has the same positions (as in the frozen inputs).
    expanded = OWN.replace("return type(module).forward(module, *args, **kwargs)",
                           "return tuple(t[:1].expand_as(t) for t in type(module).forward(module, *args, **kwargs))")
    runner = TrialRunner("cpu", Limits(compile_s=120, run_s=60))
    try:
        runner.add_problem(tmp_path / "problems" / problems[0].name)
        for source in (OWN, dense):
            trial = runner.run(Candidate(region=problems[0].name, source=source), do_time=False)
            assert trial.status is Status.ok, (trial.status, trial.reason, trial.error_text[-600:])
        trial = runner.run(Candidate(region=problems[0].name, source=expanded), do_time=False)
        assert trial.status is not Status.ok
        assert trial.status is Status.shape and "overlap" in trial.reason, (trial.status, trial.reason)
    finally:
        runner.close()


def test_a_wait_for_the_shared_reference_worker_is_not_timed_as_its_run():
    """The reference worker serves every runner: the original's timed run waited for another
    runner's request there, that wait counted as harness time, and an honest RMSNorm kernel on
    the H200 was refused for answering 'sooner than the harness's own work' (10.2 against 31.8 ms)."""
    import threading
    import time as clock
    from sandbox.runner import Reply
    from sandbox.timed_runs import batch as _batch

    class Shared:
        lock = threading.RLock()

        def request(self, header, timeout):
            with self.lock:
                clock.sleep(0.02)
                return Reply(True, header={"samples": [1.0]})

    ref, held = Shared(), threading.Event()

    def other_runner():
        with ref.lock:
            held.set()
            clock.sleep(0.5)
    t = threading.Thread(target=other_runner)
    t.start()
    held.wait(5)
    _, wall_ms = _batch(ref, {}, 10)
    t.join()
    assert 15 <= wall_ms < 200, wall_ms


def test_one_slow_run_of_the_original_does_not_refuse_an_honest_candidate(frozen):
    """The harness-time check (a reply sooner than the original's harness work is forged) read
    one run of the original: a hiccup there (11 ms of 15 on the H200) refused honest kernels and a
    compile baseline as `suspicious`. The original's run is repeated with the candidate's before
    that is concluded, and a reply forged every time is still refused."""
    import time as clock
    problem, _ = frozen["Linear"]
    runner = TrialRunner("cpu", Limits(budget_ms=30, max_reps=4, rounds=2))
    try:
        runner.add_problem(problem)
        original, batches = runner.reference.request, []

        def hiccup(msg, *a, **k):
            if msg.get("op") == "batch":
                batches.append(msg)
                if len(batches) == 2:  # the first round's original, after the warm-up
                    clock.sleep(1.0)
            return original(msg, *a, **k)
        runner.reference.request = hiccup
        trial = runner.run(Candidate(region=problem.name, source=OWN))
        runner.reference.request = original
    finally:
        runner.close()
    assert trial.status is Status.ok, (trial.status, trial.reason)
    assert len(batches) >= 4  # warm-up, the slow run, its repeat, the second round


def test_a_reply_forged_before_the_work_is_still_refused(frozen):
    problem, _ = frozen["Linear"]
    runner = TrialRunner("cpu", Limits(budget_ms=30, max_reps=4, rounds=2))
    try:
        runner.add_problem(problem)
        original = runner.reference.request

        def slow_harness(msg, *a, **k):  # every original's run shows a second of harness work
            if msg.get("op") == "batch":
                import time as clock
                clock.sleep(1.0)
            return original(msg, *a, **k)
        runner.reference.request = slow_harness
        trial = runner.run(Candidate(region=problem.name, source=OWN))
    finally:
        runner.close()
    assert trial.status is Status.suspicious and "sooner than the harness" in trial.reason, trial.reason
    assert "in each of 3 runs" in trial.reason, trial.reason


MASKED_LOGITS = """import torch
from torch import nn

class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 64)

    def forward(self, x, allowed):
        return self.fc(x).masked_fill(~allowed, float("-inf"))

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = Head()

    def forward(self, x, allowed):
        return self.head(torch.relu(x), allowed)

def get_init_inputs():
    return []

def get_inputs():
    return [torch.randn(16, 32), torch.rand(16, 64, generator=torch.Generator().manual_seed(0)) > 0.3]
"""


def test_outputs_holding_infinities_are_timed_and_spot_checked(tmp_path):
    """-inf where a mask forbids a token: with |x| * (+-1) summed, the checksum was inf - inf = NaN,
    which matches nothing, so every timed run of such a region (its own forward, a compile
    candidate, the untouched model in integration) was refused as `suspicious`."""
    (tmp_path / "masked.py").write_text(MASKED_LOGITS)
    loaded = load_model(tmp_path / "masked.py", "cpu")
    (problem,), _ = freeze(loaded, [RegionChoice("Head")], tmp_path / "run" / "problems", torch.device("cpu"))
    runner = TrialRunner("cpu", Limits(budget_ms=30, max_reps=20, rounds=2))
    try:
        runner.add_problem(tmp_path / "run" / "problems" / problem.name)
        trial = runner.run(Candidate(region=problem.name, source=OWN))
    finally:
        runner.close()
    assert trial.status is Status.ok, (trial.status, trial.reason)
    assert "spot_judge" in trial.phases  # the last round is always checked


def _measured(monkeypatch, whole_model: bool, kind: str, bands: list[float]):
    """`timed.measure` over one workload whose successive timings read `bands`."""
    import contextlib
    from types import SimpleNamespace

    from sandbox import timed
    from tools.trial import WorkloadTiming
    calls = iter(bands)

    def workload(r, lp, i, name, budget_ms, checks):
        band = next(calls)
        return WorkloadTiming(workload=name, baseline_ms=2.0, candidate_ms=1.0, baseline_spread=0.0,
                              candidate_spread=0.0, reps=5, speedup=2.0, timing_kind=kind, noise_band=band)
    monkeypatch.setattr(timed, "_workload", workload)
    quiet = SimpleNamespace(timing=lambda whole: contextlib.nullcontext(), busy=contextlib.nullcontext)
    r = SimpleNamespace(step=lambda s: None, host_quiet=quiet, device_lock=contextlib.nullcontext(),
                        quiet=contextlib.nullcontext, phases={})
    lp = SimpleNamespace(problem=SimpleNamespace(is_whole_model=whole_model, workloads=[SimpleNamespace(name="decode")]))
    retimed: list[str] = []
    return timed.measure(r, lp, 100.0, retimed), retimed, calls


def test_a_whole_models_noisy_workload_on_a_gpu_is_timed_again_and_the_quieter_kept(monkeypatch):
    """Integration's bands once read ±5-167% for minutes on an H100 (2026-12-06): a verdict inside
    ±25% says nothing, so such a workload is timed once more; the choice looks at bands only."""
    (got,), retimed, _ = _measured(monkeypatch, True, "cuda", [0.25, 0.02])
    assert got.noise_band == 0.02 and retimed == ["decode ±25.0% then ±2.0%"]
    (got,), retimed, _ = _measured(monkeypatch, True, "cuda", [0.30, 0.40])
    assert got.noise_band == 0.30 and len(retimed) == 1  # the second try was noisier: the first stays
    for whole, kind in ((True, "cuda"), (False, "cuda"), (True, "cpu")):
        band = 0.01 if (whole, kind) == (True, "cuda") else 0.5
        (got,), retimed, rest = _measured(monkeypatch, whole, kind, [band, 0.0])
        assert got.noise_band == band and retimed == [] and next(rest) == 0.0  # timed once only
