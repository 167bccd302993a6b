"""Everything but the verdict is best-effort: a FLOP count that asserts (as torch's counter
does on transformers' GQA SDPA on the GPU), a region that cannot be traced, a cost pass that
fails, become "unknown" with a note; the profile and the problem survive. And a problem that
cannot fit in memory is refused before anything is written, saying what is short."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tools import footprint
from tools.capture import RegionChoice, freeze
from tools.devices import Ceilings
from tools.footprint import Admission, DoesNotFit
from tools.modelfile import load_model
from tools.profiler import profile_model

CEILINGS = Ceilings(device_name="test", bandwidth_gbps=20.0, matmul_tflops=0.5, dtype="float32",
                    measured_at="2026-01-01T00:00:00+00:00")

ASSERTING_FLOPS = """
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import register_flop_formula


@torch.library.custom_op("nstest::gqa_attention", mutates_args=())
def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@register_flop_formula(torch.ops.nstest.gqa_attention)
def _flops(q_shape, k_shape, v_shape, *args, out_val=None, **kwargs):
    assert q_shape[1] == k_shape[1], "query/key/value shapes are incompatible"  # torch's own words
    return 0


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.kv = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 8).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, 2, 8).permute(2, 0, 3, 1, 4)
        return torch.ops.nstest.gqa_attention(q, k.contiguous(), v.contiguous()).transpose(1, 2).reshape(b, s, 32)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention()

    def forward(self, x):
        return x + self.attn(x)


def get_init_inputs():
    return []


def get_inputs():
    return [torch.randn(2, 6, 32)]
"""

UNTRACEABLE = """
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode


class Picky(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(16))

    def forward(self, x):
        # Code that refuses to run under an analysis mode: every analysis must survive it.
        if torch._C._is_torch_function_mode_enabled() or _get_current_dispatch_mode() is not None:
            raise RuntimeError("not under a mode, please")
        return torch.tanh(x) * self.w


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.picky = Picky()

    def forward(self, x):
        return self.picky(x) + 1


def get_init_inputs():
    return []


def get_inputs():
    return [torch.randn(4, 16)]
"""


def _load(tmp_path, name, source):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return load_model(path, "cpu")


def test_a_flop_formula_that_asserts_costs_the_floor_its_flops_only(tmp_path):
    loaded = _load(tmp_path, "asserting_flops", ASSERTING_FLOPS)
    result = profile_model(loaded, "cpu", None, CEILINGS, iters=1, warmup=1)
    assert {r.path for r in result.rows} >= {"", "attn"}
    problems, skipped = freeze(loaded, [RegionChoice("Attention")], tmp_path / "p", torch.device("cpu"),
                               ceilings=CEILINGS.model_dump())
    assert not skipped, skipped
    (problem,) = problems
    assert any(n.startswith("FLOP count: unknown (AssertionError: query/key/value shapes are incompatible")
               for n in problem.notes), problem.notes
    assert problem.floor_ms["default"] > 0  # from the bytes moved, still a lower bound


def test_a_region_that_refuses_analysis_is_still_profiled_and_frozen(tmp_path):
    loaded = _load(tmp_path, "untraceable", UNTRACEABLE)
    result = profile_model(loaded, "cpu", None, CEILINGS, iters=1, warmup=1, trace_path=tmp_path / "t.json")
    assert any("FLOP/byte count failed" in n for n in result.notes), result.notes
    assert (tmp_path / "t.json").is_file() and result.total_ms > 0
    problems, skipped = freeze(loaded, [RegionChoice("Picky")], tmp_path / "p", torch.device("cpu"),
                               ceilings=CEILINGS.model_dump())
    assert not skipped, skipped
    notes = " | ".join(problems[0].notes)
    assert "trace: unknown (RuntimeError: not under a mode, please)" in notes
    assert "FLOP count: unknown" in notes
    assert problems[0].graph["signature"][0]["name"] == "x"  # what needs no trace is still there


def test_a_problem_too_large_for_a_cpu_worker_is_refused_before_writing(tmp_path, monkeypatch):
    loaded = _load(tmp_path, "untraceable", UNTRACEABLE)
    monkeypatch.setattr(footprint, "CPU_WORKER_CAP_GB", footprint.CPU_WORKER_BASE_GB + 1e-6)
    problems, skipped = freeze(loaded, [RegionChoice("Picky")], tmp_path / "p", torch.device("cpu"))
    assert not problems and not (tmp_path / "p").exists()
    assert skipped[0].reason.startswith("does not fit in memory: a CPU sandbox worker would need about")


def test_admission_says_what_is_short():
    with pytest.raises(DoesNotFit, match="host memory available to freeze them"):
        Admission(torch.device("cuda"), 0, copies=True, host_free=1 << 30).admit(600 << 20, 300 << 20)
    with pytest.raises(DoesNotFit, match="one sandbox worker would need about"):
        Admission(torch.device("cuda"), 0, copies=True, host_free=4 << 30).admit(1 << 30, 1 << 28)
    fits = Admission(torch.device("cuda"), 0, copies=True, host_free=64 << 30)
    fits.admit(1 << 30, 1 << 30)
    assert fits.workers_that_fit() == 6 and "about 6 fit" in fits.note()


TWO_REGIONS = """
import os
import torch
from torch import nn


class Good(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.lin(x))


class Odd(nn.Module):  # rebuilt in a sandbox worker, it has a parameter the freeze never saw
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        if os.environ.get("NIGHTSHIFT_WORKER"):
            self.extra = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.good, self.odd = Good(), Odd()

    def forward(self, x):
        return self.odd(self.good(x))


def get_init_inputs():
    return []


def get_inputs():
    return [torch.randn(8, 16)]
"""


def test_a_problem_no_worker_can_set_up_loses_its_own_trials_only(tmp_path):
    """One region the sandbox cannot rebuild (a compiled submodule, a class that differs there)
    made every trial of every region `lost`; now only that region's."""
    from sandbox.runner import Limits, TrialRunner
    from tools.trial import Candidate, Status
    path = tmp_path / "two.py"
    path.write_text(TWO_REGIONS)
    problems, skipped = freeze(load_model(path, "cpu"), [RegionChoice("Good"), RegionChoice("Odd")],
                               tmp_path / "problems", torch.device("cpu"))
    assert not skipped, skipped
    own = "def forward(module, *args, **kwargs):\n    return type(module).forward(module, *args, **kwargs)\n"
    runner = TrialRunner("cpu", Limits(compile_s=60, run_s=60, time_s=60))
    try:
        for p in problems:
            runner.add_problem(tmp_path / "problems" / p.name)
        good = runner.run(Candidate(region="Good", source=own), do_time=False)
        odd = runner.run(Candidate(region="Odd", source=own), do_time=False)
    finally:
        runner.close()
    assert good.status is Status.ok, good.reason
    assert odd.status is Status.lost and "no longer has the frozen parameters" in odd.reason, odd.reason
