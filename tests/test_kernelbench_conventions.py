"""Habits of model files written for KernelBench, which our own files do not have, on the CPU:

- a forward that draws random numbers (level 3's LSTM draws its initial state with
  torch.randn): frozen `seeded_calls`, every call of it seeded alike, so the region's own
  forward passes and a candidate that draws other numbers is rejected, end to end too;
- tensors held as plain attributes (the RNNs' hidden state), which a model built on the meta
  device would leave without data;
- a chosen region that cannot be frozen: its parts, passed over as overlapping it, are
  frozen instead, and a tune that freezes nothing says why on its own output.
"""

from __future__ import annotations

import math
import textwrap

import torch

from sandbox.runner import Limits, TrialRunner
from tools.capture import RegionChoice, freeze
from tools.capture_model import freeze_model
from tools.modelfile import load_model
from tools.problem import Problem
from tools.region import build_region, module_state
from tools.trial import Candidate, Status

DRAWS = """
import torch
from torch import nn

class Model(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        h0 = torch.randn(x.shape[0], x.shape[1])  # as KernelBench's LSTM draws h0 and c0
        return torch.tanh(self.fc(x) + h0)

def get_init_inputs():
    return [32]

def get_inputs():
    return [torch.randn(4, 32)]
"""

OWN = "def forward(module, *args, **kwargs):\n    return type(module).forward(module, *args, **kwargs)\n"
# The same function with the random draw made twice: other numbers, so another answer.
DRAWS_OTHER = """import torch

def forward(module, x):
    torch.randn(1)
    h0 = torch.randn(x.shape[0], x.shape[1])
    return torch.tanh(module.fc(x) + h0)
"""


def _judged(folders: list, *trials: tuple[str, str]) -> list:
    """Each (region, source) verified in one sandbox runner holding the problems in `folders`."""
    runner = TrialRunner("cpu", Limits(compile_s=120, run_s=60))
    try:
        for folder in folders:
            runner.add_problem(folder)
        return [runner.run(Candidate(region=region, source=source), do_time=False) for region, source in trials]
    finally:
        runner.close()


def _write(tmp_path, name, source):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def test_a_forward_that_draws_random_numbers_is_called_seeded_and_judged(tmp_path):
    loaded = load_model(_write(tmp_path, "draws.py", DRAWS), "cpu")
    (problem,), skipped = freeze(loaded, [RegionChoice("Model")], tmp_path / "problems", torch.device("cpu"))
    assert not skipped and problem.seeded_calls, skipped
    assert any("random" in n for n in problem.notes)
    whole = freeze_model(loaded, tmp_path / "model", torch.device("cpu"))
    assert whole.seeded_calls and "random" in whole.workloads[0].tolerance_source
    regions = (problem.name, "model")
    trials = _judged([tmp_path / "problems" / problem.name, tmp_path / "model"],
                     *[(r, source) for r in regions for source in (OWN, DRAWS_OTHER)])
    for region, ok, other in zip(regions, trials[::2], trials[1::2]):
        assert ok.status is Status.ok, (region, ok.status, ok.reason, ok.error_text[-600:])
        assert other.status is not Status.ok, (region, other.status, other.reason)


HOLDS = """
import torch
from torch import nn

class Model(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.hidden = torch.zeros(4, d)

    def forward(self, x, initial_hidden):
        self.hidden.copy_(initial_hidden)
        self.hidden = torch.tanh(self.fc(x) + self.hidden)
        return self.hidden * 2

def get_init_inputs():
    return [16]

def get_inputs():
    return [torch.randn(4, 16), torch.randn(4, 16)]
"""


def test_tensors_held_as_plain_attributes_survive_a_build_on_meta(tmp_path):
    path = _write(tmp_path, "holds.py", HOLDS)
    loaded = load_model(path, "cpu")
    region = build_region(path, "", module_state(loaded.model), torch.device("cpu"), on_meta=True)
    assert region.hidden.device.type == "cpu" and not region.hidden.is_meta
    (problem,), skipped = freeze(loaded, [RegionChoice("Model")], tmp_path / "problems", torch.device("cpu"))
    assert not skipped and not problem.seeded_calls
    (ok,) = _judged([tmp_path / "problems" / problem.name], (problem.name, OWN))
    assert ok.status is Status.ok, (ok.status, ok.reason, ok.error_text[-600:])


# The model's answer depends on how often it was called (a counter, as a stateful RNN's hidden
# state does): it cannot be frozen, but its norm can.
COUNTS = """
import torch
from torch import nn

class Norm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

class Model(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = Norm(d)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        y = self.norm(x)
        for _ in range(8):
            y = y * 1.0001 + 0.001 * self.calls
        return y

def get_init_inputs():
    return [256]

def get_inputs():
    return [torch.randn(64, 256)]
"""


def test_a_region_that_cannot_be_frozen_gives_way_to_its_parts(tmp_path):
    from agent.setup.jobs import profile_and_freeze
    res = profile_and_freeze(_write(tmp_path, "counts.py", COUNTS), "cpu", None, tmp_path / "runs")
    assert "Model" in res.skipped and "differs" in res.skipped["Model"], res.skipped
    assert [p.region_class for p in res.problems] == ["Norm"], (res.problems, res.skipped)


ARGMAX = """
import torch
from torch import nn

class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return torch.argmax(x, dim=self.dim)

def get_init_inputs():
    return [1]

def get_inputs():
    return [torch.rand(8, 64, 32)]
"""
# Off by one index where the maximum sits in the upper half: integer outputs are judged exactly.
# (Only in the last row, one of 64, it missed every one of the frozen input's 256 rows once in
# about fifty draws, and read `hardcoded`: wrong on fresh inputs only.)
OFF_BY_ONE = """import torch

def forward(module, x):
    out = torch.argmax(x, dim=module.dim)
    return torch.where(out >= x.shape[module.dim] // 2, out - 1, out)
"""
AS_FLOAT = """import torch

def forward(module, x):
    return torch.argmax(x, dim=module.dim).float()
"""


def test_an_integer_output_is_frozen_and_judged_exactly(tmp_path):
    """KernelBench's argmax and argmin problems return indices: frozen with an exact
    tolerance, not skipped for having no floating-point output."""
    loaded = load_model(_write(tmp_path, "argmax.py", ARGMAX), "cpu")
    (problem,), skipped = freeze(loaded, [RegionChoice("Model")], tmp_path / "problems", torch.device("cpu"))
    assert not skipped and (problem.tolerance.kind, problem.tolerance.value) == ("abs", 0.0), skipped
    whole = freeze_model(loaded, tmp_path / "model", torch.device("cpu"))
    assert whole.workloads[0].tolerance.value == 0.0
    ok, off, cast = _judged([tmp_path / "problems" / problem.name], (problem.name, OWN),
                            (problem.name, OFF_BY_ONE), (problem.name, AS_FLOAT))
    assert ok.status is Status.ok, (ok.status, ok.reason, ok.error_text[-600:])
    assert off.status is Status.wrong, (off.status, off.reason)
    assert cast.status is Status.shape and "dtype" in cast.reason, (cast.status, cast.reason)


# KernelBench level 2's Conv3d-GroupNorm-Min-Clamp: min(x, 0) then clamp to [0, 1] is zero.
CONSTANT = """
import torch
from torch import nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.norm = nn.GroupNorm(4, 8)

    def forward(self, x):
        x = self.norm(self.conv(x))
        x = torch.min(x, torch.tensor(0.0))
        return torch.clamp(x, min=0.0, max=1.0)

def get_init_inputs():
    return []

def get_inputs():
    return [torch.rand(2, 3, 16, 16)]
"""
ZEROS = """import torch

def forward(module, x):
    n, _, h, w = x.shape
    return torch.zeros(n, module.conv.out_channels, h - 2, w - 2)
"""


NAN_HEAD = """
import torch
from torch import nn

class NanHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 8)

    def forward(self, x):
        return self.lin(x) * float("nan")

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = NanHead()

    def forward(self, x):
        return self.head(x)

def get_init_inputs():
    return []

def get_inputs():
    return [torch.randn(4, 16)]
"""
NANS = """import torch

def forward(module, x):
    return torch.full((x.shape[0], 8), float("nan"))
"""


def test_a_region_whose_output_is_constant_is_said_so_and_its_trials_flagged(tmp_path):
    loaded = load_model(_write(tmp_path, "constant.py", CONSTANT), "cpu")
    (problem,), skipped = freeze(loaded, [RegionChoice("Model")], tmp_path / "problems", torch.device("cpu"))
    assert not skipped and problem.constant_output == 0.0
    assert any("every output element is 0" in n for n in problem.notes)
    # NaN everywhere (a degenerate model) is a constant too: NaN matches NaN, so NaNs from nothing
    # passed, 4.5x "faster" and unflagged; the NaN survives the problem file (JSON null did not).
    nan_model = load_model(_write(tmp_path, "nan_head.py", NAN_HEAD), "cpu")
    (nan,), skipped = freeze(nan_model, [RegionChoice("NanHead")], tmp_path / "problems", torch.device("cpu"))
    assert not skipped and nan.constant_output is not None and math.isnan(nan.constant_output)
    assert any("every output element is nan" in n for n in nan.notes)
    assert math.isnan(Problem.load(tmp_path / "problems" / nan.name).constant_output)
    zeros, nans = _judged([tmp_path / "problems" / problem.name, tmp_path / "problems" / nan.name],
                          (problem.name, ZEROS), (nan.name, NANS))
    assert zeros.status is Status.ok and any("constant" in f for f in zeros.flags), (zeros.status, zeros.flags)
    assert nans.status is Status.ok and any("constant (nan" in f for f in nans.flags), (nans.status, nans.flags)
    other = load_model(_write(tmp_path, "argmax.py", ARGMAX), "cpu")
    (varied,), _ = freeze(other, [RegionChoice("Model")], tmp_path / "problems2", torch.device("cpu"))
    assert varied.constant_output is None


WRITES_INPUT = """
import torch
from torch import nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        x.relu_()  # into the caller's tensor, undeclared
        return self.fc(x) + x

def get_init_inputs():
    return []

def get_inputs():
    return [torch.randn(16, 32)]
"""


def test_a_region_writing_into_its_input_is_frozen_from_what_it_was_called_with(tmp_path):
    """Recorded after the call, the input would already be relu'd: the pair would not match
    and the region was skipped as depending on outside state. The version counter shows the
    write; the call is recorded again from copies taken before it."""
    loaded = load_model(_write(tmp_path, "writes.py", WRITES_INPUT), "cpu")
    (problem,), skipped = freeze(loaded, [RegionChoice("Model")], tmp_path / "problems", torch.device("cpu"))
    assert not skipped, skipped
    assert any("in place (undeclared)" in n for n in problem.notes), problem.notes
    frozen = torch.load(tmp_path / "problems" / problem.name / "inputs.pt", weights_only=True)
    assert bool((frozen[0]["args"][0] < 0).any())  # the input as called, before its relu_
    # The right answer, but the caller's tensor left as it was, where the original changes it.
    pure = "def forward(module, x):\n    y = x.relu()\n    return module.fc(y) + y\n"
    ok, left_alone = _judged([tmp_path / "problems" / problem.name], (problem.name, OWN), (problem.name, pure))
    assert ok.status is Status.ok, (ok.status, ok.reason, ok.error_text[-600:])
    assert left_alone.status is not Status.ok, (left_alone.status, left_alone.reason)


SPECTRUM = """
import torch
from torch import nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        return torch.fft.rfft(self.fc(x), dim=-1)

def get_init_inputs():
    return []

def get_inputs():
    return [torch.randn(16, 64)]
"""
# Right in modulus, wrong in phase: only a comparison of the complex values sees it.
CONJUGATE = """import torch

def forward(module, x):
    return torch.fft.rfft(module.fc(x), dim=-1).conj()
"""


def test_a_complex_output_is_compared_as_complex(tmp_path):
    loaded = load_model(_write(tmp_path, "spectrum.py", SPECTRUM), "cpu")
    (problem,), skipped = freeze(loaded, [RegionChoice("Model")], tmp_path / "problems", torch.device("cpu"))
    assert not skipped and problem.tolerance.value > 0, skipped
    whole = freeze_model(loaded, tmp_path / "model", torch.device("cpu"))
    assert "complex" in whole.workloads[0].tolerance_source
    ok, conj = _judged([tmp_path / "problems" / problem.name], (problem.name, OWN), (problem.name, CONJUGATE))
    assert ok.status is Status.ok, (ok.status, ok.reason, ok.error_text[-600:])
    assert conj.status is Status.wrong, (conj.status, conj.reason, conj.error_text[-1500:])
