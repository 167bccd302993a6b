"""Freezing regions called the way real models call them: keyword arguments, a (cos, sin)
tuple, a bool mask, a dtype, a string, a named tuple, and transformers' DynamicCache. The
frozen files load with weights_only=True; a cache, empty or holding keys, is frozen as its
tensors and rebuilt at the call (tools/objects.py), so the region reproduces its outputs in the
sandbox; on the CPU nothing is copied that need not be."""

from __future__ import annotations

import textwrap

import pytest
import torch

from sandbox.runner import TrialRunner
from tools.capture import RegionChoice, freeze
from tools.footprint import Admission
from tools.modelfile import load_model
from tools.problem import Problem
from tools.recording import record_calls
from tools.trial import Candidate, Status

MODEL = """
import collections
import torch
from torch import nn
from transformers import DynamicCache

Pair = collections.namedtuple("Pair", "a b")


class Region(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x, position_embeddings, mask=None, *, scale=1.0, mode="add", dtype=torch.float32,
                cache=None, pair=None):
        cos, sin = position_embeddings
        y = x * cos + x.flip(-1) * sin
        if mask is not None:
            y = y.masked_fill(~mask, 0.0)
        if cache is not None:
            y = y + cache.get_seq_length()  # an empty cache adds nothing
        if pair is not None:
            y = y + pair[0] - pair[1]
        y = (y * scale).to(dtype)
        return (y * self.w if mode == "mul" else y + self.w), None


class Model(nn.Module):
    def __init__(self, filled):
        super().__init__()
        self.filled = filled
        self.region = Region()

    def forward(self, x):
        cache = DynamicCache()
        if self.filled:
            cache.update(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2), 0)
        out, _ = self.region(x, (x.cos(), x.sin()), mask=x > -0.5, scale=0.5, mode="mul", dtype=torch.float64,
                             cache=cache, pair=Pair(x, 0.5 * x))
        return out


def get_init_inputs():
    return [FILLED]


def get_inputs():
    return [torch.randn(3, 8)]
"""

IDENTITY = "def forward(module, *args, **kwargs):\n    return type(module).forward(module, *args, **kwargs)\n"


def _model(tmp_path, filled: bool):
    path = tmp_path / f"signature_{'filled' if filled else 'empty'}.py"
    path.write_text(textwrap.dedent(MODEL).replace("FILLED", str(filled)))
    return load_model(path, "cpu")


@pytest.fixture(scope="module")
def empty_cache(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sig")
    problems, skipped = freeze(_model(tmp, False), [RegionChoice("Region")], tmp / "problems", torch.device("cpu"))
    assert not skipped, skipped
    return tmp / "problems" / problems[0].name


def test_arguments_are_frozen_as_called_and_load_as_plain_data(empty_cache):
    problem = Problem.load(empty_cache)
    inputs, reference, _ = problem.load_tensors(empty_cache)  # weights_only=True inside
    args, kwargs = inputs[0]["args"], inputs[0]["kwargs"]
    assert isinstance(args[0], torch.Tensor) and isinstance(args[1], tuple) and len(args[1]) == 2
    assert kwargs["mask"].dtype == torch.bool
    assert (kwargs["scale"], kwargs["mode"], kwargs["dtype"]) == (0.5, "mul", torch.float64)
    assert kwargs["cache"]["__object__"] == "transformers.cache_utils.DynamicCache" and type(kwargs["pair"]) is tuple
    assert reference[0]["structure"] == "(T,N)" and reference[0]["outputs"][0].dtype == torch.float64
    notes = " | ".join(problem.notes)
    assert "not plain data" not in notes and problem.inplace_inputs == ["kwargs.cache"]
    assert "argument pair: a Pair frozen as a plain tuple" in notes
    facts = problem.graph
    assert facts["arguments"] == {"arg0": "x", "arg1": "position_embeddings", "kw:mask": "mask", "kw:scale": "scale",
                                  "kw:mode": "mode", "kw:dtype": "dtype", "kw:cache": "cache", "kw:pair": "pair"}


def test_the_region_replays_in_the_sandbox(empty_cache):
    runner = TrialRunner("cpu")
    try:
        runner.add_problem(empty_cache)
        name = Problem.load(empty_cache).name
        ok = runner.run(Candidate(region=name, source=IDENTITY, planner="test"), do_time=False)
        assert ok.status is Status.ok, (ok.reason, ok.error_text[-600:])
        # A candidate that ignores the keyword arguments computes another function.
        bad = "def forward(module, x, pe, **kwargs):\n    return type(module).forward(module, x, pe)\n"
        wrong = runner.run(Candidate(region=name, source=bad, planner="test"), do_time=False)
        assert wrong.status is not Status.ok
    finally:
        runner.close()


def test_a_cache_that_holds_keys_is_frozen_with_them_and_rebuilt_at_the_call(tmp_path):
    problems, skipped = freeze(_model(tmp_path, True), [RegionChoice("Region")], tmp_path / "problems",
                               torch.device("cpu"))
    assert not skipped, skipped
    folder = tmp_path / "problems" / problems[0].name
    inputs, _, _ = Problem.load(folder).load_tensors(folder)
    (layer,) = inputs[0]["kwargs"]["cache"]["state"]["layers"]
    assert torch.equal(layer["state"]["keys"], torch.ones(1, 1, 2, 2))  # its state before the call
    runner = TrialRunner("cpu")
    try:
        runner.add_problem(folder)
        assert runner.run(Candidate(region=problems[0].name, source=IDENTITY, planner="test"),
                          do_time=False).status is Status.ok
        blind = ("def forward(module, *args, cache=None, **kwargs):\n"
                 "    return type(module).forward(module, *args, cache=None, **kwargs)\n")
        assert runner.run(Candidate(region=problems[0].name, source=blind, planner="test"),
                          do_time=False).status is Status.wrong
    finally:
        runner.close()


CHANGES_OUTPUT = """
import torch
from torch import nn

class Region(nn.Module):
    def forward(self, x):
        return x * 2

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.region = Region()

    def forward(self, x):
        y = self.region(x)
        y.add_(100.0)  # in place, after the region returned: the reference must not see it
        return y

def get_init_inputs():
    return []

def get_inputs():
    return [torch.randn(64, 64)]
"""


def test_on_the_cpu_inputs_are_shared_and_outputs_changed_later_are_copied(tmp_path):
    path = tmp_path / "changes_output.py"
    path.write_text(textwrap.dedent(CHANGES_OUTPUT))
    loaded = load_model(path, "cpu")
    x = loaded.workloads[0].inputs[0]
    region = loaded.model.get_submodule("region")
    inputs, outputs, calls, _ = record_calls(loaded.model, region, loaded.workloads, ["x"],
                                             Admission(torch.device("cpu"), 0, copies=False))
    assert calls == {"default": 1}
    assert torch.equal(outputs[0], x * 2)  # recorded again with copies once the change showed
    assert inputs[0]["args"][0].data_ptr() != x.data_ptr()  # that pass copies everything

    loaded.model.forward = lambda x: region(x)  # nothing changes anything: shared, not copied
    inputs, outputs, _, _ = record_calls(loaded.model, region, loaded.workloads, ["x"],
                                         Admission(torch.device("cpu"), 0, copies=False))
    assert inputs[0]["args"][0].data_ptr() == x.data_ptr()


def test_a_candidate_declares_the_regions_own_signature():
    from tools.graph import argument_names, render_signature, signature_facts

    class Odd(torch.nn.Module):
        def forward(self, a, b=2, /, c=None, *rest, d, e=torch.float32, **extra):
            return a

    params = signature_facts(Odd)
    assert render_signature(params) == "a, b=2, /, c=None, *rest, d, e=None, **extra"
    names = argument_names({"args": [1, 2, 3, 4], "kwargs": {"d": 0, "zz": 1}}, params)
    assert names == {"arg0": "a", "arg1": "b", "arg2": "c", "arg3": "rest[0]", "kw:d": "d", "kw:zz": "extra['zz']"}
    source = f"def forward(module, {render_signature(params)}):\n    return a\n"
    compile(source, "<candidate>", "exec")
    from tools.graph import call_facts
    call = {"args": [1, 2], "kwargs": {"d": None}}
    _, literals = call_facts(call, params, argument_names(call, params))
    assert literals == {"c": "None", "d": "None"}  # e's default is float32, not the None it is written as


STATEFUL = """
import torch
from torch import nn


class Counted(nn.Module):  # answers otherwise every call: no fixed answer
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return self.lin(x) + 0.01 * self.calls


class Cached(nn.Module):  # writes its buffer alike every call: the same answer, but not when it is moved
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("table", torch.zeros(16))

    def forward(self, x):
        self.table.copy_(torch.arange(16.0) / 16)
        return torch.relu(self.lin(x)) * self.table


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.bn = nn.BatchNorm1d(16)
        self.counted, self.cached = Counted(), Cached()

    def forward(self, x):
        return self.cached(self.counted(self.bn(x)))


def get_init_inputs():
    return []


def get_inputs():
    return [torch.randn(32, 16)]
"""


def test_a_region_whose_calls_change_its_answer_is_skipped_and_eval_mode_is_said(tmp_path):
    """A region that writes its own buffer and then answers otherwise has no answer to freeze:
    skipped, saying so (its trials were all `lost` as 'depends on state outside the region');
    one that writes its buffer alike each call is skipped too, since verification moves that buffer
    and the region's own forward writes it back (its own forward read `mutated_input` there); so is
    the whole model's missing reference explained. A model built in training mode is frozen in eval mode, and its
    BatchNorm's problem says so."""
    path = tmp_path / "stateful.py"
    path.write_text(STATEFUL)
    loaded = load_model(path, "cpu")
    problems, skipped = freeze(loaded, [RegionChoice(c) for c in ("Counted", "Cached", "BatchNorm1d")],
                               tmp_path / "problems", torch.device("cpu"))
    why = {s.class_name: s.reason for s in skipped}
    assert list(why) == ["Counted", "Cached"] and "changes its own parameters or buffers (calls)" in why["Counted"], why
    assert "rewrites its own parameters or buffers once they differ from the frozen ones (table)" in why["Cached"], why
    assert [p.region_class for p in problems] == ["BatchNorm1d"]
    bn = next(p for p in problems if p.region_class == "BatchNorm1d")
    assert any("frozen in eval mode" in n and "BatchNorm1d" in n for n in bn.notes), bn.notes
    from tools.capture_model import freeze_model
    with pytest.raises(ValueError, match="changes its own parameters or buffers in its forward"):
        freeze_model(loaded, tmp_path / "model", torch.device("cpu"))
