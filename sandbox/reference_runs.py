"""The reference worker's runs of the original (it never runs candidate code): its answers on
the tuner's fresh and perturbed draws (`refs`), and what it does besides returning, found when a
problem is registered (`original_effects`). The verification calls of a candidate, their
counterpart, are in sandbox/verify_runs.py."""

from __future__ import annotations

from typing import Any

from sandbox import worker_tensors as T


def refs(w: Any, req: dict) -> tuple[dict, Any]:
    """The original's outputs on fresh inputs ({set, seed}) and, with `perturb` ({sets, seed}),
    on each of those frozen sets with the region's parameters moved by `perturbed(seed)`."""
    from tools.region import flatten
    p = w.problems[req["problem"]]
    region, fwd = p["region"], p["forward"]
    out = {"fresh": [], "perturbed": None}
    with w.torch.no_grad():
        for item in req.get("fresh", []):
            args, kwargs = T.fresh_set(p, *w._draw_base(p, item["set"]), int(item["seed"]))
            out["fresh"].append([None if t is None else T.plain_tensor(t) for t in flatten(fwd(region, *args, **kwargs))[0]])
        if req.get("perturb"):
            spec = req["perturb"]
            moved = T.perturbed(region, int(spec["seed"]))
            out["perturbed"] = []
            for i in spec["sets"]:
                args, kwargs = w._device_set(p, i)
                out["perturbed"].append([None if t is None else T.plain_tensor(t)
                                         for t in flatten(fwd(moved, *args, **kwargs))[0]])
            del moved
    w._sync()
    return {}, out


def original_effects(w: Any, p: dict) -> tuple[dict, Any]:
    """What the original does besides returning: which input sets it changes in place (those
    post-call inputs come back, to be compared like outputs) and which outputs share memory
    with its inputs or parameters (a candidate may do the same there, nowhere else), and which
    of its outputs are dense row-major (a candidate's must be too there)."""
    from tools.region import flatten
    region, fwd = p["region"], p["forward"]
    mutated, post, aliases, outputs, row_major = [], [], [], [], []
    param_spans = T.spans_of(list(T.tensors_map(region).values()))
    earlier: list = []  # the last call's outputs, alive: does the original hand out one buffer twice?
    with w.torch.no_grad():
        for i in range(len(p["inputs"])):
            args, kwargs = w._device_set(p, i)
            in_spans = T.spans_of([args, kwargs])
            leaves, _ = flatten(fwd(region, *args, **kwargs))
            w._sync()
            old = T.spans_of(earlier)
            aliases.append([{"input": isinstance(t, w.torch.Tensor) and T.shares_memory(t, in_spans),
                             "param": isinstance(t, w.torch.Tensor) and T.shares_memory(t, param_spans),
                             "earlier": isinstance(t, w.torch.Tensor) and T.shares_memory(t, old)}
                            for t in leaves])
            row_major.append([isinstance(t, w.torch.Tensor) and t.is_contiguous() for t in leaves])
            earlier = [t for t in leaves if isinstance(t, w.torch.Tensor)]
            outputs.append([None if t is None else T.plain_tensor(t) for t in leaves])
            # Compared with the frozen set where the inputs live: hashing host copies of a KV cache
            # before and after each call was seconds of the reference worker's registration.
            changed = T.changed_from({"args": args, "kwargs": kwargs}, p["inputs"][i])
            mutated.append(changed)
            post.append(T.host({"args": args, "kwargs": kwargs}) if changed else None)
    return ({"mutates_inputs": mutated, "aliases": aliases, "row_major": row_major},
            {"outputs": outputs, "post_inputs": post})
