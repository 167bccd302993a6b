"""The `cache_attention` template's refusals and guards (issue 48, item 2): a mask form its kernels
cannot read gives no binding (and `hf_cache.refusal` says why); a rendered candidate raises on a
mask, mode or position table it was not verified on; and an architecture outside the five served
models (Gemma 3: custom scaling, (1 + w) q/k norms, a sliding-window layer) passes the verifier."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from agent.planners import hf_cache
from agent.planners.library import TEMPLATES, applicable, default_params, render
from sandbox.runner import TrialRunner
from tools.capture import RegionChoice, freeze
from tools.modelfile import load_model
from tools.trial import Candidate, Status

SET = Path(__file__).resolve().parents[1] / "tests" / "problems"


def _freeze(path: Path, cls: str, folder: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' config chatter
        frozen, skipped = freeze(load_model(path, "cpu"), [RegionChoice(cls)], folder, torch.device("cpu"))
    assert not skipped, skipped
    return frozen[0]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _freeze(SET / "hf_llama.py", "LlamaAttention", tmp_path_factory.mktemp("llama") / "p")


def _with_mask(problem, workload: str, dtype: str | None = None, shape: list[int] | None = None):
    """A copy of the problem whose `workload` passed a mask of another dtype or shape."""
    p = problem.model_copy(deep=True)
    w = next(w for w in p.workloads if w.name == workload)
    spec = next(s for s in w.inputs if s.dtype == "bool")
    spec.dtype, spec.shape = dtype or spec.dtype, shape or spec.shape
    return p


@pytest.mark.parametrize("change, why", [
    (dict(dtype="int64"), "int64 mask"),
    (dict(shape=[4, 32]), "2-D mask"),
    (dict(shape=[4, 2, 1, 32]), "does not broadcast"),  # per KV head: neither 1 nor the 4 query heads
    (dict(shape=[3, 1, 1, 32]), "does not broadcast"),  # a batch of 3 for 4 sequences
])
def test_a_mask_the_kernels_cannot_read_gets_no_binding(llama, change, why):
    assert hf_cache.cache_fed_attention(llama) and hf_cache.refusal(llama) is None
    p = _with_mask(llama, "decode", **change)
    assert hf_cache.cache_fed_attention(p) == [] and "cache_attention" not in {t.name for t, _ in applicable(p)}
    assert why in hf_cache.refusal(p)


def test_the_report_says_which_template_refused_a_region_and_why(llama):
    """A refusal is said where the user reads about the region, not only left out of the search;
    regions of other kinds get no such line (a decoder layer around an attention, an MLP)."""
    from agent.planners.library import refusals
    from agent.report.view import _refused
    assert refusals(llama) == [] and _refused(llama) == ""
    p = _with_mask(llama, "decode", shape=[4, 2, 1, 32])
    assert refusals(p) == [f"cache_attention: {hf_cache.refusal(p)}"]
    assert _refused(p).startswith(" No template candidate from cache_attention: workload decode: mask [4, 2, 1, 32]")
    layer = p.model_copy(deep=True)
    layer.attributes = {k: v for k, v in layer.attributes.items() if "head" not in k}  # a layer's own attributes
    assert refusals(layer) == [] and hf_cache.refusal(layer)


def test_a_per_head_float_bias_binds(llama):
    """An additive float mask per query head (ALiBi-like) is read with the head's stride."""
    p = _with_mask(llama, "decode", dtype="float32", shape=[4, 4, 1, 32])
    assert hf_cache.cache_fed_attention(p)[0]["mask_dtypes"] == ["bool", "float32"]


def test_dropout_a_missing_layer_index_or_rope_tables_of_its_own_get_no_binding(llama):
    dropout = llama.model_copy(deep=True)
    dropout.graph["attention"]["dropout"] = 0.1
    assert "dropout" in hf_cache.refusal(dropout)
    no_layer = llama.model_copy(deep=True)
    no_layer.attributes.pop("layer_idx")
    assert "layer_idx" in hf_cache.refusal(no_layer)
    tables = llama.model_copy(deep=True)
    tables.graph["rope"] = {**tables.graph["rope"], "cos": "buffer:cos", "sin": "buffer:sin"}
    assert "RoPE" in hf_cache.refusal(tables)
    for p in (dropout, no_layer, tables):
        assert hf_cache.cache_fed_attention(p) == []


def _candidate(problem, folder: Path):
    """The rendered candidate for the problem's first binding, imported from a file (Triton reads
    its kernels' source)."""
    import importlib.util
    binding = TEMPLATES["cache_attention"].bindings(problem)[0]
    path = folder / "candidate.py"
    path.write_text(render(TEMPLATES["cache_attention"], binding, default_params(TEMPLATES["cache_attention"])))
    spec = importlib.util.spec_from_file_location("cache_attention_candidate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_candidate_raises_on_a_call_it_was_not_verified_on(llama, tmp_path):
    """Bound to bool masks (and none at prefill): a float mask, a per-KV-head mask, training mode and
    2-D position tables each raise before any kernel runs, never a silently different function."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention
    forward = _candidate(llama, tmp_path).forward
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    module = LlamaAttention(config, 0).eval()
    x, cs = torch.randn(2, 3, 64), (torch.ones(2, 3, 16), torch.zeros(2, 3, 16))
    calls = {"a float mask": dict(attention_mask=torch.zeros(2, 1, 3, 3)),
             "a per-KV-head mask": dict(attention_mask=torch.ones(2, 2, 3, 3, dtype=torch.bool)),
             "2-D position tables": dict(position_embeddings=(cs[0][0], cs[1][0]))}
    for what, kw in calls.items():
        with pytest.raises(NotImplementedError):
            forward(module, x, **{"position_embeddings": cs, **kw})
    module.train()
    with pytest.raises(NotImplementedError, match="eval mode"):
        forward(module, x, position_embeddings=cs)


GEMMA3_SLIDING = 64
"""Gemma 3's sliding layer, window over every cached position: StaticCache's sliding layer over the
file's full-length tensors (tests/problems/hf_*.py) is only consistent when the window spans them."""


def gemma3_source() -> str:
    """tests/problems/hf_llama.py with Gemma 3's text model: query_pre_attn_scalar scaling (not
    head_dim ** -0.5), (1 + w) per-head q/k norms, a sliding-attention then a full-attention layer."""
    src = (SET / "hf_llama.py").read_text()
    for old, new in (("LlamaConfig, LlamaModel", "Gemma3TextConfig, Gemma3TextModel"),
                     ("LlamaConfig(", "Gemma3TextConfig("), ("LlamaModel", "Gemma3TextModel"),
                     ("vocab_size=256, max_position_embeddings=256)",
                      f"vocab_size=256, max_position_embeddings=256, query_pre_attn_scalar=24, "
                      f"sliding_window={GEMMA3_SLIDING}, layer_types=['sliding_attention', 'full_attention'])")):
        assert old in src, old
        src = src.replace(old, new)
    return src


def test_gemma3s_attention_binds_with_its_scaling_norms_and_window_and_passes(tmp_path):
    model = tmp_path / "gemma3.py"
    model.write_text(gemma3_source())
    problem = _freeze(model, "Gemma3Attention", tmp_path / "p")
    binding = TEMPLATES["cache_attention"].bindings(problem)[0]
    assert binding["scale"] == pytest.approx(24 ** -0.5) and binding["window"] == GEMMA3_SLIDING
    assert (binding["q_norm"], binding["k_norm"]) == ("q_norm", "k_norm")  # traced through x * (1 + w)
    runner = TrialRunner("cpu")
    try:
        runner.add_problem(tmp_path / "p" / problem.name)
        source = render(TEMPLATES["cache_attention"], binding, default_params(TEMPLATES["cache_attention"]))
        trial = runner.run(Candidate(region=problem.name, source=source, planner="template",
                                     template="cache_attention"), do_time=False)
        assert trial.status is Status.ok, trial.reason[:500]
    finally:
        runner.close()


SOFTCAP_CHECK = '''
import sys, torch
sys.path.insert(0, sys.argv[1])
import candidate as c
torch.manual_seed(0)
B, L = 2, 40
for S in (1, 7):
    q = torch.randn(B, 4, S, 16) * 3
    k, v = torch.randn(B, 2, L, 16) * 3, torch.randn(B, 2, L, 16)
    mask = torch.rand(B, 1, S, L) > 0.3
    mask[..., 0] = True
    got = c._attend(q, k, v, mask, None)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = torch.tanh(q @ kk.transpose(-1, -2) * c.SCALE / c.SOFTCAP) * c.SOFTCAP
    want = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ vv
    assert (got - want).abs().max() < 1e-4, (S, (got - want).abs().max())
print("ok")
'''


def test_logit_soft_capping_is_a_template_parameter_the_kernels_apply(llama, tmp_path):
    """cap * tanh(s / cap) before the mask (Gemma 2's attn_logit_softcapping), in both kernels, on
    a masked GQA call under the interpreter; transformers' SDPA cannot soft-cap, so no served
    model here reaches it: the kernels are checked against eager's formula directly."""
    import os
    import subprocess
    import sys
    binding = {**TEMPLATES["cache_attention"].bindings(llama)[0], "softcap": 5.0}
    (tmp_path / "candidate.py").write_text(render(TEMPLATES["cache_attention"], binding,
                                                  {**default_params(TEMPLATES["cache_attention"]), "BLOCK_N": 16}))
    done = subprocess.run([sys.executable, "-c", SOFTCAP_CHECK, str(tmp_path)], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]
