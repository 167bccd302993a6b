"""Problem classes (tools/classes.py): regions that compute the same thing match across model
files whatever their classes are called; regions that differ in code, shapes, dtypes,
parameters, constants or workloads never do. Each case freezes a tiny model file written here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tools.capture import RegionChoice, freeze
from tools.classes import class_key, group
from tools.modelfile import load_model

ROOT = Path(__file__).resolve().parent.parent
NORM = '''
import torch
from torch import nn

class {name}(nn.Module):
    """{doc}"""
    def __init__(self, dim, eps={eps}):
        super().__init__()
        torch.manual_seed({seed})
        self.weight = nn.Parameter(torch.rand(dim, dtype={dtype}) + 0.5)
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt({reduce} + self.eps)
        return self.weight * x32.to(x.dtype)

    def extra_repr(self):
        return "{name}"

class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = {name}(dim)
    def forward(self, x):
        return self.norm(x)

def get_init_inputs():
    return [{dim}]

def get_inputs():
    return [torch.randn({rows}, {dim}, dtype={dtype})]
'''
BASE = dict(name="LlamaNorm", doc="one norm", eps="1e-6", seed=0, dtype="torch.float32",
            reduce="x32.pow(2).mean(-1, keepdim=True)", dim=32, rows=4)
# Each differs from BASE in one thing that changes what a candidate must compute.
DIFFERENT = {
    "eps": dict(eps="1e-5"),
    "code": dict(reduce="x32.pow(2).sum(-1, keepdim=True) / x32.shape[-1]"),
    "dtype": dict(dtype="torch.float64"),
    "parameter shape": dict(dim=48),
    "workload shape": dict(rows=6),
}


def _freeze(tmp_path: Path, stem: str, **changes) -> object:
    path = tmp_path / f"{stem}.py"
    fields = {**BASE, **changes}
    path.write_text(NORM.format(**fields))
    loaded = load_model(path, "cpu")
    problems, skipped = freeze(loaded, [RegionChoice(fields["name"])], tmp_path / stem / "problems",
                               torch.device("cpu"))
    assert not skipped, skipped
    return problems[0]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return _freeze(tmp_path_factory.mktemp("base"), "base")


def test_a_copy_under_another_name_with_other_weights_and_docs_is_one_class(base, tmp_path):
    copy = _freeze(tmp_path, "copy", name="Qwen2Norm", doc="copied from Llama", seed=3)
    assert class_key(base) is not None
    assert class_key(copy) == class_key(base)
    (cls,) = group([("llama", base), ("qwen2", copy)])
    assert [(m.model, m.region) for m in cls.members] == [("llama", "LlamaNorm"), ("qwen2", "Qwen2Norm")]


@pytest.mark.parametrize("what", sorted(DIFFERENT))
def test_a_region_that_differs_is_never_merged(base, tmp_path, what):
    other = _freeze(tmp_path, "other", name="Qwen2Norm", **DIFFERENT[what])
    assert class_key(other) != class_key(base), what
    assert len(group([("llama", base), ("qwen2", other)])) == 2


def test_a_constant_read_from_an_object_the_code_does_not_show_still_tells_regions_apart(base, tmp_path):
    # The same source reads eps from a config object: attributes do not see it, the traced call does.
    hidden = NORM.replace("self.eps = eps", "self.config = type('C', (), {{'eps': eps}})()").replace(
        "+ self.eps)", "+ self.config.eps)")
    keys = []
    for eps in ("1e-6", "1e-5"):
        path = tmp_path / f"hidden{eps}.py"
        path.write_text(hidden.format(**{**BASE, "eps": eps}))
        problems, _ = freeze(load_model(path, "cpu"), [RegionChoice("LlamaNorm")], tmp_path / eps / "problems",
                             torch.device("cpu"))
        keys.append(class_key(problems[0]))
    assert None not in keys and keys[0] != keys[1]


def test_a_problem_without_a_traced_call_is_a_class_of_its_own(base):
    untraced = base.model_copy(update={"graph": {k: v for k, v in base.graph.items() if k != "computes"}})
    assert class_key(untraced) is None
    classes = group([("a", base), ("b", untraced)])
    assert len(classes) == 2 and classes[1].key == "own:b/LlamaNorm"


HF = {"hf_llama": "Llama", "hf_qwen2": "Qwen2", "hf_mistral": "Mistral"}


def test_transformers_norms_and_mlps_match_across_llama_qwen2_and_mistral_and_their_attentions_do_not(tmp_path):
    """transformers copies its RMSNorm and MLP into each model file under the model's name: one
    class each across the three. Qwen2's attention has biases and Mistral's passes a sliding window:
    each attention is a class of its own."""
    import warnings
    entries = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' config chatter
        for stem, prefix in HF.items():
            loaded = load_model(ROOT / "tests" / "problems" / f"{stem}.py", "cpu")
            choices = [RegionChoice(f"{prefix}{part}") for part in ("RMSNorm", "MLP", "Attention")]
            problems, skipped = freeze(loaded, choices, tmp_path / stem / "problems", torch.device("cpu"))
            assert not skipped, skipped
            entries += [(stem, p) for p in problems]
    classes = {tuple(f"{m.model}/{m.region}" for m in c.members) for c in group(entries)}
    assert ("hf_llama/LlamaRMSNorm", "hf_qwen2/Qwen2RMSNorm", "hf_mistral/MistralRMSNorm") in classes
    assert ("hf_llama/LlamaMLP", "hf_qwen2/Qwen2MLP", "hf_mistral/MistralMLP") in classes
    assert {("hf_llama/LlamaAttention",), ("hf_qwen2/Qwen2Attention",), ("hf_mistral/MistralAttention",)} <= classes
