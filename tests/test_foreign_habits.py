"""Habits of model files found in a sweep of foreign models on the CPU (2026-12-05), each of which
the sandbox had lost, refused or misjudged:

- a forward that draws random numbers: the compiler's candidates and compile baselines draw
  torch's numbers (fallback_random) and pass, where Inductor's own generator made them `wrong`;
- a model that reads a file beside its own (a config) when it is built, or imports one (its
  layers): built in the tuner and in the sandbox alike;
- a model that returns an object holding tensors (transformers' DynamicCache, which a causal LM
  returns by default): compared end to end by those tensors (there was no end-to-end reference);
- hooks the model registers on a region (a pre-hook scaling its input, a hook adding to its
  output): the region is its forward alone, frozen and judged as the sandbox calls it (it was
  skipped as "depends on state outside the module"), torch.compile candidates included;
- integer inputs with an order to keep (EmbeddingBag's offsets): fresh draws keep them as frozen
  (floats still move); rolled, the original itself raised and every trial was lost;
- a region torch's fast path hands nested tensors (TransformerEncoder with a padding mask):
  skipped with the reason, and the encoder around them frozen whole (a traceback had ended the
  whole tune);
- a TorchScript submodule: profiled within its parent, never frozen alone (a traceback had ended
  the tune before anything was frozen);
- an Embedding with max_norm, which rewrites its weights when they move: skipped with the reason
  (every candidate, the original's own forward included, read `mutated_input`);
- a dataclass as the model's input, or dynamically quantized Linears: no end-to-end reference,
  and the freeze says why (integration's every way had been `lost` in the sandbox).
"""

from __future__ import annotations

import torch

from agent.planners.compiler import CompilerPlanner
from agent.review.ways import compile_candidate
from test_kernelbench_conventions import DRAWS, OWN, _judged, _write
from tools.capture import RegionChoice, freeze
from tools.capture_model import freeze_model
from tools.modelfile import load_model
from tools.trial import Status


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


def _own_forward_passes(loaded, region: str, run) -> None:
    """`region` frozen under `run` (beside the model's folder, which the jail hides) and its own
    forward judged in the sandbox: it must pass."""
    (problem,), skipped = freeze(loaded, [RegionChoice(region)], run / "problems", torch.device("cpu"))
    (ok,) = _judged([run / "problems" / problem.name], (problem.name, OWN))
    assert ok.status is Status.ok, (ok.status, ok.reason, ok.error_text[-600:], skipped)


def test_a_model_that_reads_a_file_beside_its_own_is_built_in_the_sandbox(tmp_path):
    """The worker imports a copy of the model file, pinned to the frozen bytes; its `__file__` is
    the original's, so a config beside it is found (every trial was `lost` before)."""
    src = tmp_path / "src"  # the model's folder, beside the run's (which the jail hides)
    src.mkdir()
    (src / "beside.json").write_text('{"width": 24, "scale": 0.5}')
    _own_forward_passes(load_model(_write(src, "beside.py", READS_BESIDE), "cpu"), "Model", tmp_path / "run")


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
    _own_forward_passes(load_model(_write(src, "sibling.py", SIBLING), "cpu"), "Scaled", tmp_path / "run")


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

    from agent.setup.jobs import profile_and_freeze
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


BAGS = """
import torch
from torch import nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(100, 16, mode="sum")
        self.fc = nn.Linear(16 + 8, 4)

    def forward(self, dense, idx, offsets):
        return self.fc(torch.cat([self.bag(idx, offsets), dense], 1))

def get_init_inputs():
    return []

def get_inputs():
    idx = torch.randint(0, 100, (40,), generator=torch.Generator().manual_seed(0))
    return [torch.randn(10, 8), idx, torch.arange(0, 40, 4)]
"""


def test_integer_inputs_that_must_stay_ordered_are_kept_in_fresh_draws(tmp_path):
    loaded = load_model(_write(tmp_path, "bags.py", BAGS), "cpu")
    (problem,), skipped = freeze(loaded, [RegionChoice("Model")], tmp_path / "problems", torch.device("cpu"))
    whole = freeze_model(loaded, tmp_path / "model", torch.device("cpu"))
    assert problem.fixed_ints and whole.fixed_ints, skipped
    trials = _judged([tmp_path / "problems" / problem.name, tmp_path / "model"], (problem.name, OWN), ("model", OWN))
    for t in trials:
        assert t.status is Status.ok, (t.status, t.reason, t.error_text[-600:])


SCRIPTED = """
import torch
from torch import nn

class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.a(x) * torch.sigmoid(self.b(x))

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = torch.jit.script(Gate())
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        return self.out(self.gate(x))

def get_inputs():
    return [torch.randn(4, 16)]

def get_init_inputs():
    return []
"""


def test_a_torchscript_submodule_is_profiled_within_its_parent_and_never_frozen_alone(tmp_path):
    """TorchScript modules take no Python hooks: profiling a model holding one ended `agent tune`
    with a traceback before anything was frozen (a CPU sweep, 2026-12-05)."""
    from test_failsoft import CEILINGS
    from tools.profiler import profile_model
    loaded = load_model(_write(tmp_path, "scripted.py", SCRIPTED), "cpu")
    result = profile_model(loaded, "cpu", None, CEILINGS, iters=1, warmup=1)
    assert {r.path for r in result.rows} >= {"", "out"} and "gate" not in {r.path for r in result.rows}
    problems, skipped = freeze(loaded, [RegionChoice("RecursiveScriptModule"), RegionChoice("Model")],
                               tmp_path / "problems", torch.device("cpu"))
    assert [p.region_class for p in problems] == ["Model"]
    assert "TorchScript" in dict((s.class_name, s.reason) for s in skipped)["RecursiveScriptModule"], skipped
    (trial,) = _judged([tmp_path / "problems" / problems[0].name], (problems[0].name, OWN))
    assert trial.status is Status.ok, (trial.status, trial.reason, trial.error_text[-600:])


MAX_NORM = """
import torch
from torch import nn

class Model(nn.Module):
    def __init__(self, max_norm=1.0):
        super().__init__()
        self.emb = nn.Embedding(100, 8, max_norm=max_norm)
        self.out = nn.Linear(8, 4)

    def forward(self, ids):
        return self.out(self.emb(ids))

def get_inputs():
    return [torch.randint(0, 100, (6, 5), generator=torch.Generator().manual_seed(0))]

def get_init_inputs():
    return []
"""


def test_a_forward_that_rewrites_its_weights_once_they_move_is_skipped_with_the_reason(tmp_path):
    """An Embedding with max_norm renormalizes the rows it looks up in place: verification, which
    moves the weights, refused every candidate of such a model as `mutated_input`, the original's
    own forward and torch.compile of it included (a CPU sweep, 2026-12-05). Now the regions that do
    it, and the whole model, are skipped with the reason; the same model without max_norm is not."""
    loaded = load_model(_write(tmp_path, "max_norm.py", MAX_NORM), "cpu")
    problems, skipped = freeze(loaded, [RegionChoice("Model"), RegionChoice("Embedding"), RegionChoice("Linear")],
                               tmp_path / "problems", torch.device("cpu"))
    reasons = {s.class_name: s.reason for s in skipped}
    assert [p.region_class for p in problems] == ["Linear"], reasons
    for name, written in (("Model", "emb.weight"), ("Embedding", "weight")):
        assert "rewrites its own parameters" in reasons[name] and f"({written})" in reasons[name], reasons
    try:
        freeze_model(loaded, tmp_path / "model", torch.device("cpu"))
        raise AssertionError("the whole model was frozen")
    except ValueError as e:
        assert "rewrites its own parameters" in str(e) and "emb.weight" in str(e)
    plain = load_model(_write(tmp_path, "plain.py", MAX_NORM.replace("max_norm=1.0", "max_norm=None")), "cpu")
    problems, skipped = freeze(plain, [RegionChoice("Model")], tmp_path / "plain", torch.device("cpu"))
    assert len(problems) == 1 and not skipped, skipped


OBJECT_INPUT = """
import dataclasses
import torch
from torch import nn

@dataclasses.dataclass
class Batch:
    x: torch.Tensor

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, batch):
        return self.fc(batch.x)

def get_inputs():
    return [Batch(torch.randn(3, 8))]

def get_init_inputs():
    return []
"""

QUANTIZED = """
import torch
from torch import nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.ao.quantization.quantize_dynamic(nn.Sequential(nn.Linear(8, 8)), {nn.Linear}, dtype=torch.qint8)

    def forward(self, x):
        return self.net(x)

def get_inputs():
    return [torch.randn(3, 8)]

def get_init_inputs():
    return []
"""


def test_a_whole_model_the_sandbox_cannot_rebuild_has_no_end_to_end_reference_and_says_why(tmp_path):
    """Two models froze whole and then lost integration's every way in the sandbox (a CPU sweep,
    2026-12-05): one taking a dataclass (its inputs could not be loaded as plain data), one with
    dynamically quantized Linears (their packed weights are neither parameters nor buffers, so the
    rebuilt model answered otherwise). Now the freeze says so, and integration exits 2 with it."""
    import warnings
    for name, source, why in (("object_input", OBJECT_INPUT, "input[0]: a Batch"),
                              ("quantized", QUANTIZED, "state outside its parameters and buffers (net.0.")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation
            loaded = load_model(_write(tmp_path, f"{name}.py", source), "cpu")
            try:
                freeze_model(loaded, tmp_path / name, torch.device("cpu"))
                raise AssertionError(f"{name}: the whole model was frozen")
            except ValueError as e:
                assert why in str(e), str(e)
