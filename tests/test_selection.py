"""Region selection on model shapes nobody here wrote: a single op (the model itself is the
region), a GEMM with a pointwise chain (the whole forward, not the nn.Linear), a wrapper (its
child), a decoder layer (its parts), a block whose own ops finer regions would lose (whole; on
a synthetic profile, since CPU timings of tiny ops are too noisy for a threshold), and a
reason for every class that is not chosen, also when nothing is frozen."""

from __future__ import annotations

import textwrap
from itertools import combinations

import pytest

from tools.hotspots import HotspotRow, ProfileResult, WorkloadProfile, _by_class
from tools.modelfile import load_model
from tools.profiler import plan_regions, profile_model, select_regions

HEADER = """
import torch
import torch.nn.functional as F
from torch import nn

def get_init_inputs():
    return []

def get_inputs():
    return [torch.randn(16, 64)]
"""

MODELS = {
    "single_op": """
class Model(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1) * 2
""",
    "gemm_chain": """
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        return torch.relu(self.fc(x) * 0.5 + 1.0).clamp(max=3.0)
""",
    "wrapper": """
class Norm(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = Norm()

    def forward(self, x):
        return self.norm(x)
""",
    "decoder": """
class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(64, 64) for _ in range(4))

    def forward(self, x):
        a = torch.softmax(self.q(x) @ self.k(x).T / 8, dim=-1)
        return self.o(a @ self.v(x))

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))

class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.mlp = Attn(), MLP()

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x
""",
}


def _profile(tmp_path, name):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(HEADER + MODELS[name]))
    loaded = load_model(path, "cpu")
    # The least disturbed of two profiles, each module's time the median of five forwards: on
    # CI's loaded two cores a median of three let preempted ops take a model's regions whole
    # (tests/test_problem_set.py).
    return min((profile_model(loaded, "cpu", None, None, iters=5, warmup=2) for _ in range(2)),
               key=lambda r: r.total_ms)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("selection")
    return {name: _profile(tmp, name) for name in MODELS}


def _chosen(result):
    # Full coverage: which classes qualify, not where a noisy CPU profile reaches 90%.
    return {(c.class_name, tuple(c.paths)) for c in select_regions(result, coverage=1.0)}


def test_a_model_without_submodules_is_one_region(results):
    assert _chosen(results["single_op"]) == {("Model", ("",))}


def test_a_gemm_with_a_pointwise_chain_is_frozen_whole(results):
    (chosen,) = select_regions(results["gemm_chain"])
    assert (chosen.class_name, chosen.paths, chosen.share) == ("Model", [""], pytest.approx(1.0))


def test_a_wrapper_gives_way_to_the_module_it_wraps(results):
    assert _chosen(results["wrapper"]) == {("Norm", ("norm",))}
    reason = {v.class_name: v.reason for v in plan_regions(results["wrapper"])}["Model"]
    assert "wraps Norm" in reason


def test_a_decoder_layer_gives_way_to_its_parts(results):
    names = {c for c, _ in _chosen(results["decoder"])}
    assert {"Attn", "MLP"} <= names and not names & {"Layer", "Model", "Linear"}
    why = {v.class_name: v.reason for v in plan_regions(results["decoder"])}
    assert "regions of their own" in why["Layer"] and "overlaps" in why["Linear"]


def _synthetic(spec: dict[str, tuple[str, float, int]]) -> ProfileResult:
    """A profile from {path: (class, own ms, own ops)}: inclusive times add up the tree, so the
    selection logic is tested without a noisy CPU profile."""
    def incl(path: str, field: int) -> float:
        return sum(v[field] for q, v in spec.items() if q == path or path == "" or q.startswith(path + "."))

    total = incl("", 1)
    rows = []
    for path, (cls, own, ops) in spec.items():
        qual = ("torch.nn." if cls in ("Linear", "ModuleDict") else "user.") + cls
        rows.append(HotspotRow(
            path=path, class_name=cls, qualname=qual, parent=None if path == "" else path.rpartition(".")[0],
            depth=path.count(".") + 1 if path else 0, calls=0.0 if cls == "ModuleDict" else 1.0,
            inclusive_ms=incl(path, 1), self_ms=own, share=incl(path, 1) / total, kernels=incl(path, 2),
            top_kernels=[], small_kernels=0, small_kernels_ms=0, flops=0, bytes=0, op_bytes=0, floor_ms=None,
            achieved=None, bound=None, has_params=True, container=cls == "ModuleDict"))
    workload = WorkloadProfile(name="w", weight=1.0, iters=1, total_ms=total, wall_ms=total, rows=rows,
                               by_class=_by_class(rows, total))
    return ProfileResult(model_file="m.py", model_hash="", device="cpu", device_name="cpu", generation="cpu",
                         timing_kind="cpu", time_label="CPU time", torch_version="", created_at="",
                         small_kernel_us=0, ceilings=None, workloads=[workload], total_ms=total, rows=rows,
                         by_class=workload.by_class)


def test_a_block_whose_own_ops_would_be_lost_is_frozen_whole():
    """minGPT's block: the MLP's Linears sit in a ModuleDict and are called from the block's own
    forward, while Linear also lives inside the attention: descending would lose the MLP."""
    spec = {"": ("Model", 0.1, 2), "attn": ("Attn", 0.2, 3), "attn.qkv": ("Linear", 0.3, 1),
            "attn.proj": ("Linear", 0.1, 1), "mlp": ("ModuleDict", 0.0, 0), "mlp.fc": ("Linear", 0.6, 1),
            "mlp.proj": ("Linear", 0.6, 1)}
    (chosen,) = select_regions(_synthetic(spec))
    assert chosen.paths == [""]
    # With the MLP a module of its own, the same times give its parts instead.
    spec.update({"mlp": ("MLP", 0.0, 0), "": ("Model", 0.02, 2)})
    assert {c.class_name for c in select_regions(_synthetic(spec), coverage=1.0)} == {"Attn", "MLP"}


def test_every_user_class_not_frozen_is_named_with_why_and_torchs_are_not():
    """A model frozen whole around the user's gated norm (the gate a Linear inside it, a Linear
    after it): the norm overlaps the model, a class built but never called is named too."""
    from tools.selection import not_frozen
    spec = {"": ("Model", 0.1, 2), "norm": ("GatedNorm", 0.5, 6), "norm.gate": ("Linear", 0.5, 1),
            "proj": ("Linear", 0.5, 1)}
    result = _synthetic(spec)
    assert [c.class_name for c in select_regions(result)] == ["Model"]
    classes = {"Model": "user.Model", "GatedNorm": "user.GatedNorm", "Spare": "user.Spare",
               "Linear": "torch.nn.modules.linear.Linear"}
    why = not_frozen(result, {"Model"}, {}, classes)
    assert set(why) == {"GatedNorm", "Spare"}, why
    assert why["GatedNorm"].startswith("not chosen: overlaps Model, already chosen")
    assert why["GatedNorm"].endswith("; --regions GatedNorm freezes it instead")
    assert why["Spare"].startswith("not called by the model's forward")
    asked = not_frozen(result, {"GatedNorm"}, {}, classes, asked=["GatedNorm"])
    assert asked == {"Model": "not in --regions (GatedNorm)", "Spare": asked["Spare"]}
    failed = not_frozen(result, set(), {"Model": "returns no tensor to compare"}, classes)
    assert failed["Model"] == "returns no tensor to compare" and "Linear" in failed  # nothing frozen: every class


@pytest.mark.parametrize("name", sorted(MODELS))
def test_regions_never_overlap_and_every_class_has_a_reason(results, name):
    chosen = select_regions(results[name], coverage=1.0, max_regions=20)
    for a, b in combinations(chosen, 2):
        for p in a.paths:
            for q in b.paths:
                assert not (p == q or q.startswith(p + ".") or p.startswith(q + ".") or "" in (p, q)), (a, b)
    verdicts = plan_regions(results[name])
    assert {v.qualname for v in verdicts} == {c.qualname for c in results[name].by_class}
    assert all(v.reason for v in verdicts)


def test_profile_says_why_for_each_class_when_nothing_is_frozen(tmp_path):
    """The only region returns a Python number (no tensor to compare) and has no parts to freeze instead:
    `profile` must not come back with an empty list of reasons."""
    from agent.setup.jobs import profile_and_freeze
    path = tmp_path / "argmax.py"
    path.write_text(textwrap.dedent(HEADER + """
class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(10, 64))

    def forward(self, x):
        return float((x @ self.weight.t()).max())

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = Head()

    def forward(self, x):
        return self.head(x)
"""))
    res = profile_and_freeze(path, "cpu", None, tmp_path / "runs")
    assert not res.problems
    assert "no tensor to compare" in res.skipped["Head"]
    assert res.skipped["Model"].startswith("not chosen:") and "Head" in res.skipped["Model"]
