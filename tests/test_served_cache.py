"""transformers' models served as transformers serves them (issue 48, item 1): tests/problems/hf_*.py
run over transformers' own StaticCache with the example's workloads, and a region sees the cache,
its mask and position embeddings as transformers passes them. The cache object is frozen as its
tensors and rebuilt at each call (tools/objects.py); what the call writes into it is judged like
any in-place output: a candidate that leaves it stale is wrong, one that writes elsewhere has
mutated an input."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from sandbox.runner import TrialRunner
from tools.capture import RegionChoice, freeze
from tools.modelfile import load_model
from tools.objects import is_marker, rebuild
from tools.problem import Problem
from tools.trial import Candidate, Status

SET = Path(__file__).resolve().parents[1] / "tests" / "problems"
OWN = "def forward(module, *args, **kwargs):\n    return type(module).forward(module, *args, **kwargs)\n"
# Reads the cache, then puts back what it held: this call's keys and values never land in it.
STALE = '''
def forward(module, *args, cache=None, **kwargs):
    saved = [(l.keys.clone(), l.values.clone()) for l in cache.layers]
    out = type(module).forward(module, *args, cache=cache, **kwargs)
    for l, (k, v) in zip(cache.layers, saved):
        l.keys.copy_(k)
        l.values.copy_(v)
    return out
'''
# Right, and then a write into the history before it (position 0, where there is one).
ASTRAY = '''
def forward(module, *args, cache=None, **kwargs):
    out = type(module).forward(module, *args, cache=cache, **kwargs)
    if int(kwargs["cache_position"][0]) > 0:
        cache.layers[module.layer_idx].keys[:, :, 0] += 1.0
    return out
'''


@pytest.mark.parametrize("stem", ["hf_llama", "hf_mistral", "hf_gpt2"])
def test_a_decode_step_over_the_served_cache_is_the_uncached_forwards_last_position(stem):
    model = load_model(SET / f"{stem}.py", "cpu").model
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    *_, (_, k_cache, v_cache, _) = [w["inputs"] for w in _workloads(stem)]
    shape = (k_cache.shape[0], 2, k_cache.shape[2], 9, k_cache.shape[4])
    k, v = torch.zeros(shape), torch.zeros(shape)
    with torch.no_grad():
        model(ids[:, :8], k, v, 0)  # prefill writes positions 0..7
        step = model(ids[:, 8:], k, v, 8)
        whole = model.model(input_ids=ids, use_cache=False).last_hidden_state
    assert bool(k[:, :, :, 8].abs().sum() > 0)  # the step wrote its own position
    torch.testing.assert_close(step[:, 0], whole[:, 8], atol=1e-5, rtol=1e-5)


def _workloads(stem: str) -> list[dict]:
    import importlib.util
    spec = importlib.util.spec_from_file_location(stem, SET / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.get_workloads().values())


@pytest.fixture(scope="module")
def attention(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("served") / "problems"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        problems, skipped = freeze(load_model(SET / "hf_llama.py", "cpu"), [RegionChoice("LlamaAttention")], folder,
                                   torch.device("cpu"))
    assert not skipped, skipped
    return folder / problems[0].name


def test_the_attention_is_frozen_with_the_cache_transformers_passes(attention):
    problem = Problem.load(attention)
    inputs, _, _ = problem.load_tensors(attention)  # plain data: weights_only=True inside
    assert problem.inplace_inputs == ["kwargs.cache"] and [w.name for w in problem.workloads] == \
        ["prefill", "decode", "small_batch"]
    decode = inputs[1]["kwargs"]
    assert is_marker(decode["cache"]) and decode["cache"]["__object__"].endswith("StaticCache")
    cache = rebuild(decode["cache"])
    assert type(cache).__name__ == "StaticCache" and len(cache.layers) == 2
    layer = cache.layers[0]
    assert layer.keys.shape == (4, 2, 32, 16) and int(layer.cumulative_length) == 31  # its state before the call
    assert bool(layer.keys[:, :, :31].abs().sum() > 0) and not bool(layer.keys[:, :, 31:].abs().sum() > 0)
    assert decode["cache_position"].tolist() == [31] and decode["position_embeddings"][0].shape[-2] == 1


def test_the_sandbox_judges_what_the_call_writes_into_the_cache(attention):
    name = Problem.load(attention).name
    runner = TrialRunner("cpu")
    try:
        runner.add_problem(attention)
        verdicts = {label: runner.run(Candidate(region=name, source=src, planner="test"), do_time=False)
                    for label, src in (("own", OWN), ("stale", STALE), ("astray", ASTRAY))}
    finally:
        runner.close()
    assert verdicts["own"].status is Status.ok, verdicts["own"].reason
    assert verdicts["stale"].status is Status.wrong and "kwargs.cache" in verdicts["stale"].reason
    assert verdicts["astray"].status is Status.mutated_input and "wrong positions" in verdicts["astray"].reason
