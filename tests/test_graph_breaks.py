"""transformers' LlamaModel (tests/problems/hf_llama.py, small, on the CPU) with our winners
routed in per shape, then compiled whole ("nightshift + torch.compile"): no graph break, neither
on the shapes routed to the original nor on the one that runs our kernels.

On the H100 (2026-12-07) every compiled way with our kernels said "15 graph breaks" and ran
prefill in 14 compiled regions, 5.1 ms where torch.compile alone took 3.1-3.6 ms, though prefill
was routed to the original. Two causes, both here:

1. The dispatchers' table was keyed on the frozen input sets, where the StaticCache the model
   passes is a marker (a dict of its tensors, tools/objects.py); at the call it is an object the
   key skips. No workload of the attention matched its row, so every call ran the dispatcher's
   default, our kernel, the shapes routed to the original included.
2. A call of our kernel that no custom op can express (an argument that is a transformers Cache)
   ran behind `torch.compiler.disable`: a break per layer, and under torch 2.13 a break nested in
   transformers' frames makes dynamo restart at the callers, where their own Python (the
   dict-key iteration of output_capturing.py) breaks again. `cache_attention` now traces whole:
   its Triton launches are one custom op, and the cache's own update is the compiler's.
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from agent.planners.library import TEMPLATES, applicable, default_params, render
from agent.prompting import render_code
from agent.review.dispatch import ShapeChoice, dispatch_source, input_keys, shape_key
from agent.review.ways import composed_candidate
from tools.capture import RegionChoice, freeze
from tools.modelfile import load_model
from tools.objects import rebuild
from tests.test_composed import _load  # a candidate loaded as the worker loads it

SET = Path(__file__).resolve().parents[1] / "tests" / "problems"
CLASSES = ("LlamaAttention", "LlamaMLP", "LlamaRMSNorm")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gb") / "problems"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' config chatter
        loaded = load_model(SET / "hf_llama.py", "cpu", check_forward=False)
        frozen, skipped = freeze(loaded, [RegionChoice(c) for c in CLASSES], folder, torch.device("cpu"))
    assert not skipped, skipped
    return loaded, {p.region_class: p for p in frozen}, folder


def _template(problem, name: str) -> str:
    binding = next(b for t, b in applicable(problem) if t.name == name)
    return render(TEMPLATES[name], binding, default_params(TEMPLATES[name]))


def _on_decode_only(problem, folder: Path, source: str) -> str:
    """The winner on decode, the original on prefill and small_batch, the winner elsewhere: what
    integration routes into the compiled ways (agent/review/dispatch.without_workloads)."""
    winner = SimpleNamespace(candidate_hash="winner")
    keys = input_keys(problem, folder / problem.name)
    choices = [ShapeChoice(w.name, k, winner if w.name == "decode" else None) for w, k in zip(problem.workloads, keys)]
    return dispatch_source(choices, {"winner": source}, winner)


def test_a_cache_fed_regions_keys_are_the_ones_its_calls_make(llama):
    """The key of a frozen input set is the key of the call the model makes with it: the Cache
    object, not the marker's tensors."""
    _, problems, folder = llama
    p = problems["LlamaAttention"]
    inputs, _, _ = p.load_tensors(folder / p.name, inputs=True, state=False)
    for s, key in zip(inputs, input_keys(p, folder / p.name)):
        args, kwargs = rebuild(list(s["args"])), rebuild(dict(s["kwargs"]))
        cache = [name for name, v in kwargs.items() if type(v).__name__ == "StaticCache"]
        assert len(cache) == 1, sorted(kwargs)
        assert key == shape_key(args, kwargs) == shape_key(args, {k: v for k, v in kwargs.items() if k != cache[0]})


def compile_routed(tmp: Path, shapes: tuple[str, ...] = ("prefill", "decode", "small_batch")) -> dict:
    """The routed small Llama compiled whole (aot_eager, each graph's code kept): per workload
    of `shapes`,
    dynamo's graph breaks, and the graphs compiled with the count of our kernels' custom ops
    (the attention's) and of the opaque ops our winners became (the RMSNorm's) in them. Run with
    TRITON_INTERPRET=1 set before triton is first imported (the attention's kernels, on the CPU)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' config chatter
        loaded = load_model(SET / "hf_llama.py", "cpu", check_forward=False)
        frozen, skipped = freeze(loaded, [RegionChoice(c) for c in CLASSES], tmp / "problems", torch.device("cpu"))
    assert not skipped, skipped
    problems = {p.region_class: p for p in frozen}
    routes = [(problems[cls], _on_decode_only(problems[cls], tmp / "problems", source(problems[cls]))) for cls, source in (
        ("LlamaAttention", lambda p: _template(p, "cache_attention")),
        ("LlamaMLP", lambda p: render_code("kernels/torch_compile.py.j2", mode=None, options={})),
        ("LlamaRMSNorm", lambda p: _template(p, "rmsnorm")))]
    way = _load(tmp / "gb_way.py", composed_candidate(routes, None).source)
    graphs: list[str] = []

    def backend(gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager
        graphs.append(gm.code)
        return aot_eager(gm, example_inputs)

    way._HOW = {"backend": backend}
    model, original = loaded.model, copy.deepcopy(loaded.model)
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    out = {}
    with torch.no_grad():
        for w in loaded.workloads:
            if w.name not in shapes:
                continue
            before, seen = dict(counters["graph_break"]), len(graphs)
            for _ in range(2):  # the eager call that records each op, then the compiled one
                ours, theirs = copy.deepcopy(list(w.inputs)), copy.deepcopy(list(w.inputs))
                got, want = way.forward(model, *ours), original(*theirs)
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(ours[1:3], theirs[1:3], atol=1e-4, rtol=1e-4)  # the caches written alike
            code = "".join(graphs[seen:])
            out[w.name] = {"breaks": {k.splitlines()[0][:160]: v - before.get(k, 0)
                                      for k, v in counters["graph_break"].items() if v > before.get(k, 0)},
                           "graphs": len(graphs) - seen, "kernel_ops": code.count("nightshift_kernels."),
                           "opaque_ops": code.count("torch.ops.nightshift.")}
    return out


def test_the_routed_llama_compiles_whole_on_every_shape(tmp_path):
    """small_batch runs the original (one graph, no op of ours in it); decode runs our attention
    (its kernels a custom op per layer, the cache's update compiled) and our RMSNorm (an opaque
    op per instance), in one graph too. Before the fix: a break per layer on each (prefill, not
    compiled here for time, had none on the CPU: compiled, transformers passes it a mask its
    eager call did not, and such a call ran the original already; on the H100 it broke too)."""
    import json
    import os
    import subprocess
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    got = subprocess.run([sys.executable, "-m", "tests.test_graph_breaks", str(tmp_path), "decode", "small_batch"], env=env,
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=240)
    assert got.returncode == 0, got.stderr[-3000:]
    seen = json.loads(got.stdout.strip().splitlines()[-1])
    assert {w: s["breaks"] for w, s in seen.items()} == {"decode": {}, "small_batch": {}}, seen
    assert {w: (s["graphs"], s["kernel_ops"], s["opaque_ops"]) for w, s in seen.items()} == {
        "decode": (1, 2, 5), "small_batch": (1, 0, 0)}, seen


if __name__ == "__main__":  # python -m tests.test_graph_breaks FOLDER, from the repository's root
    import json
    print(json.dumps(compile_routed(Path(sys.argv[1]), tuple(sys.argv[2:]) or ("prefill", "decode", "small_batch"))))
