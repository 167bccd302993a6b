"""How a candidate that uses torch.compile really runs, seen from inside its worker.

A compiled way of running can silently run eager: a frame dynamo skipped (one called under a
Python dispatch mode is skipped for good), a recompile limit reached, graph breaks between
graphs. Its time then is eager time under the name "torch.compile". So every compiled way
reports dynamo's own counters (graphs, graph breaks, recompiles, frames) and one profiled call
per input set: how many compiled regions it entered, which graphs, and how many compute ops ran
outside them.
`tools.trial.compile_fallback` turns that into the label the report shows. Diagnostic only: the verdict and
the times never depend on what a candidate's process says here.
"""

from __future__ import annotations

from typing import Any, Callable

REGION = "Torch-Compiled Region"
"""The profiler's name for a compiled frame's execution (dynamo records it around each one)."""
NOT_COMPUTE = ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::clone", "aten::copy_",
               "aten::detach", "aten::to", "aten::_to_copy", "aten::view", "aten::lift_fresh", "aten::alias",
               "aten::resize_", "aten::set_", "aten::zeros")
"""Ops outside a compiled region that are the harness's or a wrapper's copies, not model work."""


def counters() -> dict[str, int]:
    """dynamo's counters now, flattened: graphs compiled, graph breaks, recompiles, frames, and
    Inductor's graph-cache hits and misses."""
    from torch._dynamo.utils import counters as c
    return {"graphs": int(c["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(c["graph_break"].values())),
            "recompiles": int(sum(c["recompiles"].values())),
            "frames": int(c["frames"].get("total", 0)),
            "frames_ok": int(c["frames"].get("ok", 0)),
            # Inductor's graph cache: a way compiled from a copy of another's cache should hit it
            # wherever its graphs are the other's (a composed way where the compiler's code runs).
            "fx_cache_hits": int(c["inductor"].get("fxgraph_cache_hit", 0)),
            "fx_cache_misses": int(c["inductor"].get("fxgraph_cache_miss", 0))}


def probe(calls: list[Callable[[], Any]], before: dict[str, int]) -> dict[str, Any]:
    """Counters since `before`, then each call once under the profiler (CPU events only)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    now = counters()
    out: dict[str, Any] = {k: v - before.get(k, 0) for k, v in now.items()}
    out["regions"], out["eager_ops"], out["eager_examples"], out["graphs_run"] = [], [], [], []
    for call in calls:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            call()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        regions, eager, ran = 0, [], set()
        for e in prof.events():
            if e.name.startswith(REGION):
                regions += 1
                ran.add(e.name[len(REGION):].lstrip(": "))
            elif e.name.startswith("aten::") and e.name not in NOT_COMPUTE and not _inside_region(e):
                eager.append(e.name)
        out["regions"].append(regions)
        out["eager_ops"].append(len(eager))
        out["eager_examples"].append(sorted(set(eager))[:5])
        # Which compiled graphs ran ("frame/compile"): a shape seen after others may run a dynamic
        # graph compiled for another one (dynamo tries its newest graph first).
        out["graphs_run"].append(sorted(ran))
    return out


def _inside_region(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(REGION):
            return True
        parent = parent.cpu_parent
    return False

