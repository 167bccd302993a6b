"""transformers' own attention, MLP and norm modules (Llama, Qwen2, Qwen3, Mistral, GPT-2,
random weights from small configs) get template candidates that the sandbox's verifier
passes, under the Triton interpreter on the CPU in fp32.

These regions are called the way transformers calls them when it serves the model: keyword
arguments, `position_embeddings=(cos, sin)`, its masks, its StaticCache (tests/problems/hf_*.py),
Conv1D weights in GPT-2. The bindings come from the traced graph (which weight feeds which matmul, where cos
and sin come from), not from attribute names.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from agent.planners.library import TEMPLATES, applicable, default_params, render
from sandbox.runner import TrialRunner
from tools.capture import RegionChoice, freeze
from tools.modelfile import load_model
from tools.trial import Candidate, Status

SET = Path(__file__).resolve().parents[1] / "tests" / "problems"
REGIONS = {
    "hf_llama": ("LlamaAttention", "LlamaMLP", "LlamaRMSNorm"),
    "hf_qwen2": ("Qwen2Attention", "Qwen2MLP", "Qwen2RMSNorm"),
    "hf_qwen3": ("Qwen3Attention", "Qwen3MLP", "Qwen3RMSNorm"),
    "hf_mistral": ("MistralAttention", "MistralMLP", "MistralRMSNorm"),
    "hf_gpt2": ("GPT2Attention", "GPT2MLP", "LayerNorm"),
}
EXPECTED = {"Attention": "cache_attention", "MLP": ("gated_mlp", "mlp"), "RMSNorm": "rmsnorm", "LayerNorm": "layernorm"}
TRIES = 4


@pytest.fixture(scope="module")
def regions(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "problems"
    problems = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for stem, classes in REGIONS.items():
            loaded = load_model(SET / f"{stem}.py", "cpu")
            frozen, skipped = freeze(loaded, [RegionChoice(c) for c in classes], folder, torch.device("cpu"))
            assert not skipped, skipped
            problems.update({(stem, p.region_class): p for p in frozen})
    runner = TrialRunner("cpu")
    for p in problems.values():
        runner.add_problem(folder / p.name)
    yield problems, runner
    runner.close()


@pytest.mark.parametrize("stem, region", [(s, c) for s, cs in REGIONS.items() for c in cs])
def test_a_template_candidate_passes(regions, stem, region):
    """Each region's first candidates, on all three workloads (prefill with an empty cache and no mask,
    decode over the cache with a bool mask, a small batch after a cached prefix)."""
    problems, runner = regions
    problem = problems[(stem, region)]
    offered = applicable(problem)
    kind = next(v for k, v in EXPECTED.items() if region.endswith(k))
    assert any(t.name in ((kind,) if isinstance(kind, str) else kind) for t, _ in offered), \
        [t.name for t, _ in offered]
    tried = []
    for template, binding in offered[:TRIES]:
        trial = _run(runner, problem, template, binding)
        tried.append((template.name, trial.status.value, trial.reason[:200]))
        if trial.status is Status.ok:
            return
    pytest.fail(f"no template candidate passed for {stem} {region}: {tried}")


def _run(runner, problem, template, binding, **params):
    source = render(template, binding, {**default_params(template), **params})
    return runner.run(Candidate(region=problem.name, source=source, planner="template", template=template.name),
                      do_time=False)


def _cache_binding(problem) -> dict:
    found = [b for t, b in applicable(problem) if t.name == "cache_attention"]
    assert found, [t.name for t, _ in applicable(problem)]
    return found[0]


@pytest.mark.parametrize("stem", ["hf_llama", "hf_gpt2"])
@pytest.mark.parametrize("params", [{"path": "sdpa"}, {"BLOCK_M": 16, "BLOCK_N": 16, "SPLITS": 4}],
                         ids=["sdpa", "small_tiles"])
def test_the_cache_templates_other_paths_pass_too(regions, stem, params):
    """SDPA over the cache (is_causal without a mask, the mask otherwise, enable_gqa), and the Triton
    kernels with small tiles (several query and key blocks, several decode splits to merge)."""
    problems, runner = regions
    problem = problems[(stem, REGIONS[stem][0])]
    trial = _run(runner, problem, TEMPLATES["cache_attention"], _cache_binding(problem), **params)
    assert trial.status is Status.ok, trial.reason[:500]


def test_a_candidate_that_ignores_the_mask_fails_the_verifier(regions):
    """Bound as if the calls passed no mask, the kernels attend causally from position 0 (prefill
    right) and to every slot of the static cache at decode: the verifier must say wrong."""
    problems, runner = regions
    problem = problems[("hf_llama", "LlamaAttention")]
    binding = {**_cache_binding(problem), "mask": None, "mask_dtypes": [], "mask_none": True}
    trial = _run(runner, problem, TEMPLATES["cache_attention"], binding)
    assert trial.status is Status.wrong, (trial.status, trial.reason[:300])


def test_attention_bindings_come_from_the_trace(regions):
    problems, _ = regions
    llama = _cache_binding(problems[("hf_llama", "LlamaAttention")])
    assert llama["rope"] == "arg" and llama["cos"] == "position_embeddings[0]"
    assert (llama["q_w"], llama["o_w"]) == ("q_proj.weight", "o_proj.weight")
    assert (llama["cache"], llama["mask"], llama["mask_dtypes"], llama["mask_none"]) == \
        ("cache", "attention_mask", ["bool"], True)  # None at prefill, bool at decode and small batch
    assert llama["scale"] == 0.25 and (llama["num_heads"], llama["num_kv_heads"]) == (4, 2)
    assert not any(g[0] == "attention_mask" for g in llama["guards"])  # the mask is taken, not refused
    assert "hidden_states, position_embeddings=None" in llama["signature"]
    gpt2 = _cache_binding(problems[("hf_gpt2", "GPT2Attention")])
    assert (gpt2["packed"], gpt2["in_layout"], gpt2["rope"]) == ("c_attn.weight", "matmul", "none")
    assert gpt2["mask"] == "attention_mask" and gpt2["mask_dtypes"] == ["bool"]
    qwen3 = _cache_binding(problems[("hf_qwen3", "Qwen3Attention")])
    assert (qwen3["q_norm"], qwen3["k_norm"]) == ("q_norm", "k_norm")
    for stem, classes in REGIONS.items():  # no template that would ignore the cache binds
        assert {t.name for t, _ in applicable(problems[(stem, classes[0])])} == {"cache_attention"}


GEMMA_NORM = '''
import torch
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm = GemmaRMSNorm(64, eps=1e-6)
        with torch.no_grad():
            self.norm.weight.normal_(0.0, 0.5)  # zero-init in transformers: 1 + 0 would hide the offset

    def forward(self, x):
        return self.norm(x)


def get_inputs():
    return [torch.randn(4, 16, 64)]


def get_init_inputs():
    return []
'''


def _freeze_one(tmp_path: Path, source: str, cls: str):
    """The one region `cls` of the model file `source`, frozen under tmp_path/p."""
    model = tmp_path / f"{cls.lower()}.py"
    model.write_text(source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' config chatter
        (problem,), skipped = freeze(load_model(model, "cpu"), [RegionChoice(cls)], tmp_path / "p", torch.device("cpu"))
    assert not skipped, skipped
    return problem


def test_gemmas_norm_scales_by_one_plus_weight_and_its_template_knows(regions, tmp_path):
    """Gemma's RMSNorm is x * rstd * (1 + w): the rmsnorm template binds that form where the
    trace shows the second add (Llama's shows one and gets only its own), and passes."""
    problems, _ = regions
    llama = [b for t, b in applicable(problems[("hf_llama", "LlamaRMSNorm")]) if t.name == "rmsnorm"]
    assert llama and {b["unit_offset"] for b in llama} == {False}
    problem = _freeze_one(tmp_path, GEMMA_NORM, "GemmaRMSNorm")
    offered = [(t, b) for t, b in applicable(problem) if t.name == "rmsnorm"]
    assert [b["unit_offset"] for _, b in offered][:1] == [True]
    runner = TrialRunner("cpu")
    try:
        runner.add_problem(tmp_path / "p" / problem.name)
        verdicts = {}
        for template, binding in offered[:2]:
            trial = runner.run(Candidate(region=problem.name, source=render(template, binding, default_params(template)),
                                         planner="template", template=template.name), do_time=False)
            verdicts[binding["unit_offset"]] = trial.status
        assert verdicts[True] is Status.ok and verdicts.get(False, Status.wrong) is Status.wrong, verdicts
    finally:
        runner.close()


BERT = '''
import torch
from torch import nn
from transformers import BertConfig, BertModel


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        config = BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=256,
                            max_position_embeddings=64, num_hidden_layers=1)
        self.model = BertModel(config).eval()

    def forward(self, ids):
        return self.model(input_ids=ids).last_hidden_state


def get_inputs():
    return [torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))]


def get_init_inputs():
    return []
'''


def test_the_trace_keeps_templates_off_regions_that_compute_something_else(regions, tmp_path):
    """A LayerNorm subtracts the mean (its trace shows layer_norm): no rmsnorm candidate for it,
    only its own norm template. BERT's self-attention holds three square projections, as
    a gated MLP would, but its trace shows no gated MLP: no gated_mlp candidate (it would
    return one tensor where the region returns two, a trial spent for nothing)."""
    problems, _ = regions
    names = lambda p: {t.name for t, _ in applicable(p)}  # noqa: E731
    assert "layernorm" in names(problems[("hf_gpt2", "LayerNorm")])
    assert "rmsnorm" not in names(problems[("hf_gpt2", "LayerNorm")])
    assert "rmsnorm" in names(problems[("hf_llama", "LlamaRMSNorm")])
    attn = _freeze_one(tmp_path, BERT, "BertSelfAttention")
    assert (attn.graph or {}).get("matmuls"), attn.graph
    assert not {"gated_mlp", "mlp_dual_gemm", "mlp"} & names(attn), names(attn)


def test_a_traced_layer_norm_binds_its_weight_and_bias_as_called(regions):
    """nn.LayerNorm starts with weight 1 and bias 0: a binding with the two swapped is right on
    the frozen parameters and wrong on moved ones, a trial spent on a known loser."""
    problems, _ = regions
    bound = [(b["weight"], b["bias"]) for t, b in applicable(problems[("hf_gpt2", "LayerNorm")]) if t.name == "layernorm"]
    assert bound and set(bound) == {("weight", "bias")}, bound


DICT_INPUT = '''
import torch
from torch import nn


class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.out = nn.Linear(64, 10)

    def forward(self, feats, extras):
        return self.out(self.proj(feats["a"]) + feats["b"] + sum(extras))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = Mixer()

    def forward(self, feats, extras):
        return self.mix(feats, extras)


def get_inputs():
    return [{"a": torch.randn(32, 64), "b": torch.randn(32, 64)}, [torch.randn(32, 64)]]


def get_init_inputs():
    return []
'''


def test_no_template_binds_a_region_whose_arguments_hold_no_tensor_of_their_own(tmp_path):
    """Two chained projections (an MLP to the trace) whose input is a dict of tensors: every
    template reads its main input as a tensor, so each candidate raised on the dict (two of four
    trials of a CPU tune of such a model)."""
    problem = _freeze_one(tmp_path, DICT_INPUT, "Mixer")
    assert len((problem.graph or {}).get("matmuls") or []) == 2, problem.graph
    assert applicable(problem) == []
