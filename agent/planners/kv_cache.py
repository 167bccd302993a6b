"""Bindings for attention over a KV cache: a region that declares two in-place outputs (the
key and value caches, `Problem.inplace_inputs`) and takes the number of cached positions.

The rule reads the region's signature (from the freeze's trace), the projections by shape
(names only order the guesses), the RoPE tables, and the workload mix: every workload's
batch, new tokens, cache length and share of the metric, which the templates write into the
candidate (a decode-heavy mix sizes the split-KV parts; the planner's order puts the template
for the heaviest phase first, `library.applicable`).
"""

from __future__ import annotations

from itertools import permutations

from agent.planners.bindings import HINTS
from tools.graph import render_signature
from tools.problem import Problem

LEN_HINTS = ("len", "pos", "offset", "past")


def arg_name(path: str, names: list[str]) -> str | None:
    """The argument an in-place input path (`args.1`, `kwargs.cache`) names in the signature."""
    kind, _, key = path.partition(".")
    if kind == "kwargs":
        return key
    return names[int(key)] if key.isdigit() and int(key) < len(names) else None


def mix(problem: Problem) -> list[dict]:
    """Per workload: name, batch, new tokens, cached tokens before the call, share of the metric."""
    out, weights = [], problem.weights
    for w in problem.workloads:
        if len(w.inputs) < 2 or len(w.inputs[0].shape) != 3 or len(w.inputs[1].shape) != 4:
            continue
        batch, new = w.inputs[0].shape[0], w.inputs[0].shape[1]
        out.append({"name": w.name, "batch": batch, "new": new, "cache": w.inputs[1].shape[2] - new,
                    "share": round(weights[w.name], 4)})
    return out


def decode_share(problem: Problem) -> float:
    """The share of the metric on one-new-token calls (decode)."""
    return sum(m["share"] for m in mix(problem) if m["new"] == 1)


def _hinted(names: list[str], role: str) -> list[str]:
    return sorted(names, key=lambda n: not any(h in n.lower() for h in HINTS.get(role, (role,))))


def kv_cache_attention(problem: Problem) -> list[dict]:
    if len(problem.inplace_inputs) != 2:
        return []
    params = (problem.graph or {}).get("signature") or []
    names = [p["name"] for p in params]
    caches = [arg_name(p, names) for p in problem.inplace_inputs]
    lens = [n for n in names if n not in caches and any(h in n.lower() for h in LEN_HINTS)]
    if None in caches or not lens or len(names) < 4:
        return []
    attrs = problem.attributes
    heads, kv_heads, hd = attrs.get("num_heads"), attrs.get("num_kv_heads"), attrs.get("head_dim")
    if not all(isinstance(v, int) and v > 0 for v in (heads, kv_heads, hd)) or heads % kv_heads:
        return []
    two_d = {p.name: p.shape for p in problem.parameters if len(p.shape) == 2}
    hidden = next((w.inputs[0].shape[-1] for w in problem.workloads if w.inputs), None)
    qs = _hinted([n for n, s in two_d.items() if s == [heads * hd, hidden]], "q_w")
    kvs = _hinted([n for n, s in two_d.items() if s == [kv_heads * hd, hidden]], "k_w")
    os_ = _hinted([n for n, s in two_d.items() if s == [hidden, heads * hd] and n not in qs[:1]], "o_w")
    tables = [n for n, s in two_d.items() if s[1] == hd and s[0] != heads * hd]
    cos, sin = _hinted(tables, "cos")[:1], _hinted(tables, "sin")[:1]
    if not (qs and len(kvs) >= 2 and os_ and cos and sin) or cos == sin:
        return []
    base = {"signature": render_signature(params), "x": names[0], "guards": [],
            "k_cache": caches[0], "v_cache": caches[1], "cache_len": lens[0],
            "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": hd, "cos": cos[0], "sin": sin[0],
            "mix": mix(problem)}
    # Both orders of the two same-shaped K/V projections; the named order first.
    pairs = sorted(permutations(_hinted(kvs, "k_w")[:2], 2), key=lambda kv: "v" in kv[0].lower())
    return [{**base, "q_w": qs[0], "k_w": k, "v_w": v, "o_w": os_[0]} for k, v in pairs]
