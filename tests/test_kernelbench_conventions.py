"""Habits of model files written for KernelBench, which our own files do not have, on the CPU:

- a forward that draws random numbers (level 3's LSTM draws its initial state with
  torch.randn): frozen `seeded_calls`, every call of it seeded alike, so the region's own
  forward passes and a candidate that draws other numbers is rejected, end to end too; the
  compiler's candidates and compile baselines draw torch's numbers (fallback_random) and pass;
- a model that reads a file beside its own (a config) when it is built, or imports one (its
  layers): built in the tuner and in the sandbox alike;
- a model that returns an object holding tensors (transformers' DynamicCache, which a causal LM
  returns by default): compared end to end by those tensors (there was no end-to-end reference);
- hooks the model registers on a region (a pre-hook scaling its input, a hook adding to its
  output): the region is its forward alone, frozen and judged as the sandbox calls it (it was
  skipped as "depends on state outside the module"), torch.compile candidates included;
- a region torch's fast path hands nested tensors (TransformerEncoder with a padding mask):
  skipped with the reason, the rest frozen (a traceback ended the whole tune);
- tensors held as plain attributes (the RNNs' hidden state), which a model built on the meta
  device would leave without data;
- a chosen region that cannot be frozen: its parts, passed over as overlapping it, are
  frozen instead, and a tune that freezes nothing says why on its own output.
"""

from __future__ import annotations

import textwrap

import torch

from sandbox.runner import Limits, TrialRunner
from tools.capture import RegionChoice, freeze
from tools.capture_model import freeze_model
from tools.modelfile import load_model
from tools.region import build_region, module_state
from agent.planners.compiler import CompilerPlanner
from agent.ways import compile_candidate
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


def test_the_compilers_candidates_draw_the_originals_random_numbers(tmp_path):
    """torch.compile with Inductor's own generator draws other numbers than the eager original
    seeded alike: every compiler candidate and every compile baseline of such a model was `wrong`
    (a CPU tune and integration of a sampling model, 2026-12-05). With fallback_random they pass."""
    loaded = load_model(_write(tmp_path, "draws.py", DRAWS), "cpu")
    (problem,), _ = freeze(loaded, [RegionChoice("Model")], tmp_path / "problems", torch.device("cpu"))
    freeze_model(loaded, tmp_path / "model", torch.device("cpu"))
    ours = CompilerPlanner().candidate(problem, None, {})
    assert ours.params.get("eager_rng") is True
    plain = compile_candidate(None)
    trials = _judged([tmp_path / "problems" / problem.name, tmp_path / "model"],
                     (problem.name, ours.source), ("model", compile_candidate(None, eager_rng=True).source),
                     ("model", plain.source))
    for t in trials[:2]:
        assert t.status is Status.ok, (t.status, t.reason, t.error_text[-600:])
    assert trials[2].status is Status.wrong, (trials[2].status, trials[2].reason)


READS_BESIDE = """
import json
from pathlib import Path

import torch
from torch import nn

CONFIG = json.loads(Path(__file__).with_name("beside.json").read_text())

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(CONFIG["width"], CONFIG["width"])

    def forward(self, x):
        return torch.relu(self.fc(x)) * CONFIG["scale"]

def get_init_inputs():
    return []

def get_inputs():
    return [torch.randn(4, 24)]
"""


def test_a_model_that_reads_a_file_beside_its_own_is_built_in_the_sandbox(tmp_path):
    """The worker imports a copy of the model file, pinned to the frozen bytes; its `__file__` is
    the original's, so a config beside it is found (every trial was `lost` before)."""
    src = tmp_path / "src"  # the model's folder, beside the run's (which the jail hides)
    src.mkdir()
    (src / "beside.json").write_text('{"width": 24, "scale": 0.5}')
    loaded = load_model(_write(src, "beside.py", READS_BESIDE), "cpu")
    (problem,), _ = freeze(loaded, [RegionChoice("Model")], tmp_path / "run" / "problems", torch.device("cpu"))
    (ok,) = _judged([tmp_path / "run" / "problems" / problem.name], (problem.name, OWN))
    assert ok.status is Status.ok, (ok.status, ok.reason, ok.error_text[-600:])


SIBLING = """
import torch
from torch import nn
from sibling_blocks import Scaled

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = Scaled(16)

    def forward(self, x):
        return self.body(x) + 1

def get_init_inputs():
    return []

def get_inputs():
    return [torch.randn(4, 16)]
"""

BLOCKS = """
import torch
from torch import nn

class Scaled(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return torch.sigmoid(self.fc(x)) * 3
"""


def test_a_model_that_imports_a_file_beside_its_own_is_built_in_the_tuner_and_the_sandbox(tmp_path):
    """`from sibling_blocks import Scaled` works when the file runs as a script (its folder is on the
    path); the tuner refused the model with ModuleNotFoundError unless run from that folder."""
    src = tmp_path / "src"
    src.mkdir()
    _write(src, "sibling_blocks.py", BLOCKS)
    loaded = load_model(_write(src, "sibling.py", SIBLING), "cpu")
    (problem,), _ = freeze(loaded, [RegionChoice("Scaled")], tmp_path / "run" / "problems", torch.device("cpu"))
    (ok,) = _judged([tmp_path / "run" / "problems" / problem.name], (problem.name, OWN))
    assert ok.status is Status.ok, (ok.status, ok.reason, ok.error_text[-600:])


ENCODER = """
import torch
from torch import nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True)

    def forward(self, x, pad):
        return self.enc(x, src_key_padding_mask=pad)

def get_init_inputs():
    return []

def get_inputs():
    pad = torch.zeros(2, 8, dtype=torch.bool)
    pad[1, 5:] = True
    return [torch.randn(2, 8, 32), pad]
"""


def test_a_region_handed_nested_tensors_is_skipped_with_the_reason(tmp_path):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors' prototype warning
        loaded = load_model(_write(tmp_path, "encoder.py", ENCODER), "cpu")
        problems, skipped = freeze(loaded, [RegionChoice("TransformerEncoderLayer"), RegionChoice("TransformerEncoder")],
                                   tmp_path / "problems", torch.device("cpu"))
    assert [s.class_name for s in skipped] == ["TransformerEncoderLayer"], skipped
    assert "nested" in skipped[0].reason, skipped[0].reason
    assert [p.region_class for p in problems] == ["TransformerEncoder"]


def test_the_region_around_parts_that_cannot_be_frozen_is_chosen_instead(tmp_path):
    """The profile picks the encoder's layers; they cannot be frozen, so the encoder around them
    is frozen whole (it was passed over as made of them, and the run had no problem at all)."""
    import warnings

    from agent.jobs import profile_and_freeze
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = profile_and_freeze(_write(tmp_path, "encoder.py", ENCODER), "cpu", None, tmp_path / "runs")
    assert "nested" in res.skipped.get("TransformerEncoderLayer", ""), res.skipped
    assert "TransformerEncoder" in [p.region_class for p in res.problems], (res.problems, res.skipped)


CACHE_OUT = """
import torch
from torch import nn

class Layer:
    def __init__(self, keys, values):
        self.keys, self.values, self.dtype = keys, values, keys.dtype

class Cache:
    def __init__(self):
        self.layers, self.seen = [], 0

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        cache = Cache()
        cache.layers.append(Layer(h * 2, torch.sigmoid(h)))
        cache.seen = x.shape[0]
        return {"logits": torch.tanh(h), "cache": cache}

def get_init_inputs():
    return []

def get_inputs():
    return [torch.randn(4, 16)]
"""

# Right logits, a cache holding other keys: the next decode step would read them.
STALE_KEYS = """import torch

def forward(module, x):
    out = type(module).forward(module, x)
    out["cache"].layers[0].keys = out["cache"].layers[0].keys * 1.01
    return out
"""
# Right values in transposed strides: the rival torch.compile hands back such outputs too.
TRANSPOSED = """import torch

def forward(module, x):
    out = type(module).forward(module, x)
    out["logits"] = out["logits"].t().contiguous().t()
    return out
"""


def test_a_model_returning_an_object_that_holds_tensors_is_compared_by_them(tmp_path):
    loaded = load_model(_write(tmp_path, "cache_out.py", CACHE_OUT), "cpu")
    freeze_model(loaded, tmp_path / "model", torch.device("cpu"))
    own, stale, transposed = _judged([tmp_path / "model"], ("model", OWN), ("model", STALE_KEYS), ("model", TRANSPOSED))
    assert own.status is Status.ok, (own.status, own.reason, own.error_text[-600:])
    assert stale.status is Status.wrong, (stale.status, stale.reason)
    assert transposed.status is Status.ok, (transposed.status, transposed.reason)


HOOKED = """
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.fc(x))

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        for b in self.blocks:
            b.register_forward_pre_hook(lambda m, args: (args[0] * 0.5,))
            b.register_forward_hook(lambda m, args, out: out + 1.0)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x

def get_init_inputs():
    return []

def get_inputs():
    return [torch.randn(4, 16)]
"""


def test_a_region_with_hooks_is_its_forward_alone(tmp_path):
    loaded = load_model(_write(tmp_path, "hooked.py", HOOKED), "cpu")
    problems, skipped = freeze(loaded, [RegionChoice("Block")], tmp_path / "problems", torch.device("cpu"))
    assert not skipped and len(problems) == 1, skipped
    (problem,) = problems
    compiled = CompilerPlanner().candidate(problem, None, {})
    trials = _judged([tmp_path / "problems" / problem.name], (problem.name, OWN), (problem.name, compiled.source))
    for t in trials:
        assert t.status is Status.ok, (t.status, t.reason, t.error_text[-600:])


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
    from agent.jobs import profile_and_freeze
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


def test_a_region_whose_output_is_constant_is_said_so_and_its_trials_flagged(tmp_path):
    loaded = load_model(_write(tmp_path, "constant.py", CONSTANT), "cpu")
    (problem,), skipped = freeze(loaded, [RegionChoice("Model")], tmp_path / "problems", torch.device("cpu"))
    assert not skipped and problem.constant_output == 0.0
    assert any("every output element is 0" in n for n in problem.notes)
    (zeros,) = _judged([tmp_path / "problems" / problem.name], (problem.name, ZEROS))
    assert zeros.status is Status.ok and any("constant" in f for f in zeros.flags), (zeros.status, zeros.flags)
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
    assert conj.status is Status.wrong, (conj.status, conj.reason)
