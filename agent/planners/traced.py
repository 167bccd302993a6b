"""Bindings from what the region computes: the facts `tools.graph` traced at freeze time
(`Problem.graph`). They say which parameter feeds which matmul and in which layout, which
activation sits between two matmuls, where RoPE's tables and SDPA's mask come from, and what
the region's own signature is. A rule here returns [] when the facts are missing or do not
describe its kind of region; the shape rules in `bindings` then guess as before.
"""

from __future__ import annotations

from tools.graph import render_signature
from tools.problem import Problem

GENERIC = {"signature": "x, *args, **kwargs", "x": "x", "guards": []}
# Names a candidate file defines at module level or uses as its first parameter.
RESERVED = {"module", "torch", "F", "triton", "tl", "math", "x"}


def call_vars(problem: Problem) -> dict | None:
    """How a candidate's forward is declared: the region's own signature (so the model's real
    call reaches it, keywords included), the expression of its main input, and the arguments
    that were None or a bool when it was frozen (the candidate refuses other values). None where
    the region takes no floating tensor as an argument at all (a dict of them, a list): every
    kernel template reads its main input as one."""
    g = problem.graph or {}
    params = g.get("signature") or []
    names = [p["name"] for p in params]
    main = next((i["expr"] for i in g.get("inputs", []) if i.get("kind") == "tensor"
                 and i.get("dtype", "").startswith(("float", "bfloat"))), None)
    if main is None and g.get("inputs"):
        return None
    if not params or main is None or any(n in RESERVED - {"x"} or n.startswith("_") for n in names):
        return dict(GENERIC)
    guards = [[n, v] for n, v in (g.get("literals") or {}).items() if n in names]
    return {"signature": render_signature(params), "x": main, "guards": guards}


def _weights(problem: Problem) -> dict[str, list[int]]:
    return {p.name: p.shape for p in problem.parameters}


def _expr(origin: str | None) -> tuple[str, str | None]:
    """("arg", expression) for an input, ("module", name) for a buffer/parameter, ("none", None)."""
    if not origin:
        return "none", None
    kind, _, rest = origin.partition(":")
    return ("arg", rest) if kind == "input" else ("module", rest) if kind in ("buffer", "param") else ("none", None)


def attention(problem: Problem) -> list[dict]:
    """An SDPA region: separate q/k/v projections or one packed projection split in three,
    optional per-head q/k norms, RoPE tables from an argument or a buffer, the mask from an
    argument, the scale SDPA was given, and an output projection; all from the trace."""
    g = problem.graph or {}
    a, mms = g.get("attention"), {m["weight"]: m for m in g.get("matmuls", [])}
    if not a or not a.get("out") or a["out"] not in mms:
        return []
    shapes = _weights(problem)
    q, k, v, o = a["q"]["matmul"], a["k"]["matmul"], a["v"]["matmul"], a["out"]
    if None in (q, k, v) or any(w not in mms for w in (q, k, v)):
        return []
    om = mms[o]
    q_out = shapes[o][1] if om["layout"] == "linear" else shapes[o][0]
    hd = _head_dim(problem, q_out)
    if hd is None:
        return []
    packed = q == k == v
    if packed:
        if (a["q"]["chunk"], a["k"]["chunk"], a["v"]["chunk"]) != (0, 1, 2):
            return []
        m = mms[q]
        total = shapes[q][0] if m["layout"] == "linear" else shapes[q][1]
        kv_out = (total - q_out) // 2
    else:
        m = mms[k]
        kv_out = shapes[k][0] if m["layout"] == "linear" else shapes[k][1]
    layouts = {mms[w]["layout"] for w in (q, k, v)}
    if len(layouts) != 1 or layouts & {"conv"} or om["layout"] == "conv" or kv_out <= 0 or kv_out % hd:
        return []
    if (q_out // hd) % (kv_out // hd):
        return []
    rope = g.get("rope") or {}
    rope_kind, cos = _expr(rope.get("cos"))
    _, sin = _expr(rope.get("sin"))
    if rope and not {q, k} <= set(rope.get("applied_to", [])):
        return []  # RoPE on something else than q and k: not this template's function
    norms = {mm: p.rpartition(".")[0] for p, mm in (g.get("norm_weights") or {}).items() if p.endswith("weight")}
    q_norm, k_norm = norms.get(q), norms.get(k)
    if packed and (q_norm or k_norm):
        return []
    mask_kind, mask = _expr(a.get("mask_origin"))
    if a.get("mask_origin") and mask_kind != "arg":
        return []  # a mask the region makes itself: the template would have to make it too
    binding = {
        "packed": q if packed else None, "packed_b": mms[q]["bias"] if packed else None,
        "q_w": None if packed else q, "k_w": None if packed else k, "v_w": None if packed else v,
        "q_b": None if packed else mms[q]["bias"], "k_b": None if packed else mms[k]["bias"],
        "v_b": None if packed else mms[v]["bias"], "in_layout": layouts.pop(),
        "o_w": o, "o_b": om["bias"], "o_layout": om["layout"],
        "q_norm": q_norm if q_norm and k_norm else None, "k_norm": k_norm if q_norm and k_norm else None,
        "rope": rope_kind if cos and sin else "none", "cos": cos, "sin": sin,
        "mask": mask, "scale": a.get("scale"), "causal": bool(a.get("is_causal")),
        "returns": g.get("returns", "T"),
        "head_dim": hd, "num_heads": q_out // hd, "num_kv_heads": kv_out // hd}
    if mask:  # a mask argument the trace saw: the template passes it on, so no guard on it
        binding["guards"] = [gd for gd in (call_vars(problem) or GENERIC)["guards"] if gd[0] != mask]
    # transformers passes is_causal=False for one query; a traced decode call cannot tell.
    causal = [binding["causal"]] if binding["causal"] or mask or problem.attributes.get("is_causal") is False \
        else [True, False] if problem.attributes.get("is_causal") is not True else [True]
    return [{**binding, "causal": c} for c in causal]


def _ints(problem: Problem) -> dict[str, int]:
    return {k: v for k, v in problem.attributes.items()
            if "." not in k and isinstance(v, int) and not isinstance(v, bool) and v > 0}


def _head_dim(problem: Problem, q_out: int) -> int | None:
    """head_dim from the module's attributes: `head_dim` itself, or q's width over a head count
    (`num_heads`, `n_head`, `heads`, ...; not the KV heads)."""
    ints = _ints(problem)
    if ints.get("head_dim") and q_out % ints["head_dim"] == 0:
        return ints["head_dim"]
    heads = [v for k, v in ints.items() if "head" in k and not any(t in k for t in ("kv", "key", "dim", "group"))]
    return next((q_out // h for h in heads if q_out % h == 0 and (q_out // h) % 2 == 0), None)


def plain_ops(problem: Problem) -> set[str] | None:
    """The names of the traced ops (None when the region was not traced)."""
    g = problem.graph or {}
    return {o["op"] for o in g["ops"]} if "ops" in g else None


def linear(problem: Problem) -> list[dict] | None:
    """act(x @ W.T + b) when the trace shows exactly that: one matmul and at most an
    activation after it. None without a trace (shapes decide), [] when it shows more."""
    g = problem.graph or {}
    if "ops" not in g:
        return None
    mms = g.get("matmuls") or []
    rest = [o["op"] for o in g["ops"] if o["op"] not in ("linear", "addmm", "mm", "matmul")]
    acts = {"relu": "relu", "gelu": None, "silu": "silu"}
    if len(mms) != 1 or mms[0]["layout"] != "linear" or len(rest) > 1 or (rest and rest[0] not in acts):
        return []
    act = "none" if not rest else acts[rest[0]]
    return [{"weight": mms[0]["weight"], "bias": mms[0]["bias"], "act": a}
            for a in ([act] if act else ["gelu", "gelu_tanh"])]


def gated_mlp(problem: Problem) -> list[dict]:
    """down(act(gate(x)) * up(x)) with nn.Linear layouts: gate is the matmul whose output passes
    an activation on its way into down, up the one that goes in unchanged."""
    return gated_mlp_of((problem.graph or {}).get("matmuls") or [])


def gated_mlp_of(mms: list[dict]) -> list[dict]:
    """`gated_mlp` from traced matmuls (a region's, or those of one child of it)."""
    if len(mms) != 3 or any(m["layout"] != "linear" for m in mms):
        return []
    down = mms[2]
    gate = [m for m in mms[:2] if m.get("feeds") == down["weight"] and m.get("act") not in (None, "none")]
    up = [m for m in mms[:2] if m.get("feeds") == down["weight"] and m.get("act") == "none"]
    if len(gate) != 1 or len(up) != 1 or gate[0]["act"] not in ("silu", "gelu", "gelu_tanh"):
        return []
    return [{"gate_w": gate[0]["weight"], "gate_b": gate[0]["bias"], "up_w": up[0]["weight"], "up_b": up[0]["bias"],
             "down_w": down["weight"], "down_b": down["bias"], "act": gate[0]["act"]}]


def packed_gated_mlp(problem: Problem) -> list[dict]:
    """down(act(g) * u) with g and u the two halves of ONE projection (Phi-3's gate_up_proj): two
    nn.Linear matmuls, the first [2I, H] feeding the second [H', I] through an activation and a
    product. The trace does not see the split (a view), so both halves are offered as the gate,
    the first half first."""
    return packed_gated_mlp_of((problem.graph or {}).get("matmuls") or [], _weights(problem), plain_ops(problem))


def packed_gated_mlp_of(mms: list[dict], shapes: dict[str, list[int]], ops: set[str] | None) -> list[dict]:
    """`packed_gated_mlp` from traced matmuls (a region's, or those of one child of it)."""
    if len(mms) != 2 or any(m["layout"] != "linear" for m in mms) or "mul" not in (ops or ()) \
            or mms[0].get("feeds") != mms[1]["weight"] or mms[0].get("act") not in ("silu", "gelu", "gelu_tanh"):
        return []
    if shapes[mms[0]["weight"]][0] != 2 * shapes[mms[1]["weight"]][1]:
        return []
    return [{"packed": mms[0]["weight"], "packed_b": mms[0]["bias"], "gate_first": first, "down_w": mms[1]["weight"],
             "down_b": mms[1]["bias"], "act": mms[0]["act"]} for first in (True, False)]


def mlp(problem: Problem) -> list[dict]:
    """proj(act(fc(x))): two matmuls, the first feeding the second through an activation."""
    g = problem.graph or {}
    mms = g.get("matmuls") or []
    if g.get("attention") or len(mms) != 2 or mms[0].get("feeds") != mms[1]["weight"] \
            or any(m["layout"] == "conv" for m in mms):
        return []
    shapes = _weights(problem)
    inner = [shapes[m["weight"]][0 if m["layout"] == "linear" else 1] for m in mms[:1]] + \
            [shapes[m["weight"]][1 if m["layout"] == "linear" else 0] for m in mms[1:]]
    if inner[0] != inner[1]:
        return []  # something between the two matmuls changes the width: not an MLP
    act = mms[0].get("act")
    if act == "sigmoid":  # a gate: sigmoid(fc(x)) times another tensor, not an MLP's activation
        return []
    acts = [act] if act in ("relu", "gelu", "gelu_tanh", "silu", "none") else ["relu", "gelu", "gelu_tanh", "silu"]
    return [{"w1": mms[0]["weight"], "b1": mms[0]["bias"], "layout1": mms[0]["layout"],
             "w2": mms[1]["weight"], "b2": mms[1]["bias"], "layout2": mms[1]["layout"], "act": a} for a in acts]
