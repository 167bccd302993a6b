"""The concatenated weights that the fused-QKV attention and gated-MLP templates keep on a module
(`_cached_cat` in prompts/kernels/_macros.j2): always the weights as they are now, and never a
tensor kept from a CUDA graph's memory pool. Kept from the pool, it made `nightshift +
reduce-overhead` fail on transformers' LlamaModel (H100, 2026-12-06: "Detected 2 tensor(s) in
the cudagraph pool not tracked as outputs"): verification moves the weights, so the buffer was
rebuilt inside torch.compile's warm-up, which allocates from the graphs' pool."""

from __future__ import annotations

import pytest
import torch

from agent.planners.library import _environment


def _cached_cat():
    source = _environment().from_string(
        '{% import "kernels/_macros.j2" as m %}import torch\n{{ m.cached_cat() }}\n').render()
    scope: dict = {}
    exec(compile(source, "<cached_cat>", "exec"), scope)
    return scope["_cached_cat"]


def _module():
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.randn(4, 3))
    m.b = torch.nn.Parameter(torch.randn(2, 3))
    return m


def test_moved_weights_are_written_into_the_kept_buffer():
    cat, m = _cached_cat(), _module()
    with torch.no_grad():
        first = cat(m, "_w", [m.a, m.b])
        assert torch.equal(first, torch.cat([m.a, m.b]))
        assert cat(m, "_w", [m.a, m.b]) is first  # unchanged weights: the kept one
        m.a.mul_(3.0)  # moved in place, as verification moves parameters
        again = cat(m, "_w", [m.a, m.b])
        assert again is first and torch.equal(again, torch.cat([m.a, m.b]))  # rebuilt in place
        m.b = torch.nn.Parameter(torch.randn(5, 3))  # another shape: a new buffer
        grown = cat(m, "_w", [m.a, m.b])
        assert grown.shape == (9, 3) and torch.equal(grown, torch.cat([m.a, m.b]))


def test_a_buffer_built_under_inference_mode_is_not_written_outside_it():
    """An inference tensor may not be written outside inference mode: it is built anew."""
    cat, m = _cached_cat(), _module()
    with torch.inference_mode():
        first = cat(m, "_w", [m.a, m.b])
    with torch.no_grad():
        m.a.add_(1.0)
        again = cat(m, "_w", [m.a, m.b])
    assert again is not first and torch.equal(again, torch.cat([m.a, m.b]).detach())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_inside_a_cuda_graph_capture_nothing_is_kept():
    cat, m = _cached_cat(), _module().cuda()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        with torch.cuda.graph(graph):
            got = cat(m, "_w", [m.a, m.b])
    assert got is None and "_w" not in m.__dict__
