"""How a kernel template could apply to a problem, from what the region computes.

A binding is a plain dict of template variables: which parameter plays which role
(`gate_w`, `cos`, ...), which child to call, and constants (`eps`, `head_dim`, `act`). The
rules here never read the region's source. Where the freeze traced the region
(`Problem.graph`, see `agent/planners/traced.py`), the trace says which parameter feeds which
matmul, which activation follows it, where RoPE's tables and the mask come from. Otherwise,
and where the trace cannot tell two roles apart, shapes decide: every assignment is offered
and the verifier's tolerance decides which one computes the same function. Names only
*order* the guesses, so the likely one is tried first, and cap how many are kept.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from itertools import permutations, product

from agent.planners import traced
from tools.problem import Problem, TensorSpec

EPS_DEFAULTS = (1e-5, 1e-6)
GATED_ACTS = ("silu", "gelu_tanh", "gelu")
LINEAR_ACTS = ("none", "relu", "gelu", "gelu_tanh", "silu")
HEAD_DIMS = (128, 64, 256, 96, 80, 32, 16)
MAX_BINDINGS = 16
DECODE_ROWS = 64
"""A workload with at most this many rows (tokens) is decode-shaped: bandwidth-bound GEMMs."""

FLOAT_DTYPES = {"float16", "bfloat16", "float32", "float64"}

# Substrings that make a name the likely holder of a role (ordering only).
HINTS: dict[str, tuple[str, ...]] = {
    "weight": ("weight", "scale", "gamma"),
    "bias": ("bias", "beta"),
    "gate_w": ("gate", "w1", "fc1"),
    "up_w": ("up", "w3"),
    "down_w": ("down", "w2", "fc2"),
    "q_w": ("q_proj", "query", "wq", "to_q"),
    "k_w": ("k_proj", "key", "wk", "to_k"),
    "v_w": ("v_proj", "value", "wv", "to_v"),
    "o_w": ("o_proj", "out", "wo", "dense", "to_out"),
    "cos": ("cos",),
    "sin": ("sin",),
    "norm1": ("input", "norm1", "ln_1", "attn_norm", "pre"),
    "norm2": ("post", "norm2", "ln_2", "ffn_norm", "mlp_norm"),
    "mixer1": ("attn", "attention", "mixer"),
    "mixer2": ("mlp", "ffn", "feed", "moe"),
}


# -- facts about a problem -----------------------------------------------------------------
def _floats(specs: Iterable[TensorSpec]) -> list[TensorSpec]:
    return [s for s in specs if s.dtype in FLOAT_DTYPES]


def single_io(problem: Problem) -> tuple[list[int], list[int]] | None:
    """(input shape, output shape) of the first workload when every workload has exactly one
    float tensor in and one out and all agree on the last dims; else None."""
    shapes = []
    for w in problem.workloads:
        ins, outs = _floats(w.inputs), _floats(w.outputs)
        if len(ins) != 1 or len(outs) != 1 or not ins[0].shape or not outs[0].shape:
            return None
        shapes.append((ins[0].shape, outs[0].shape))
    first = shapes[0]
    if any(i[-1] != first[0][-1] or o[-1] != first[1][-1] or len(i) != len(first[0])
           for i, o in shapes):
        return None
    return first


def same_shape_io(problem: Problem) -> int | None:
    """N when the region maps one [..., N] tensor to one tensor of the same shape."""
    io = single_io(problem)
    if io is None or io[0] != io[1]:
        return None
    if any(_floats(w.inputs)[0].shape != _floats(w.outputs)[0].shape for w in problem.workloads):
        return None
    return io[0][-1]


def rows(problem: Problem) -> int:
    """The most rows (product of all but the last dim) any workload feeds the region."""
    return max(math.prod(_floats(w.inputs)[0].shape[:-1]) if _floats(w.inputs) else 0
               for w in problem.workloads)


def shaped(problem: Problem, shape: list[int]) -> list[str]:
    return [p.name for p in problem.parameters if p.shape == shape]


def bias_for(problem: Problem, weight: str, n: int) -> str | None:
    """The bias that sits next to a weight (`fc.weight` -> `fc.bias`) when it is [n]."""
    prefix = weight.rpartition(".")[0]
    name = f"{prefix}.bias" if prefix else "bias"
    return name if [n] in [p.shape for p in problem.parameters if p.name == name] else None


def biases(problem: Problem, weight: str, n: int) -> list[str | None]:
    """Who may be a weight's bias: its conventional neighbour, else any [n] vector; or none."""
    named = bias_for(problem, weight, n)
    return [named] if named else [p.name for p in problem.parameters if p.shape == [n]] + [None]


def eps_candidates(problem: Problem, prefix: str = "") -> tuple[float, ...]:
    """Small positive float attributes of the module (or of child `prefix`), else the usual."""
    found = []
    for key, value in problem.attributes.items():
        owner, _, attr = key.rpartition(".")
        if owner != prefix or isinstance(value, bool) or not isinstance(value, float):
            continue
        if 0 < value < 0.1 and value not in found:
            found.append(value)
    return tuple(found) or EPS_DEFAULTS


def children_params(problem: Problem, child: str) -> list[TensorSpec]:
    return [p for p in problem.parameters if p.name.startswith(child + ".")]


def ranked(bindings: list[dict]) -> list[dict]:
    """Most name hints matched first (stable, so enumeration order breaks ties), capped."""
    def score(b: dict) -> int:
        return sum(1 for var, value in b.items()
                   if isinstance(value, str) and any(h in value.lower() for h in HINTS.get(var, ())))
    return sorted(bindings, key=score, reverse=True)[:MAX_BINDINGS]


# -- one rule per kind of region -----------------------------------------------------------
def _norm_region(problem: Problem) -> tuple[int, list[str]] | None:
    """A norm region: same-shape [..., N] in/out and only [N] parameters (at least one)."""
    n = same_shape_io(problem)
    if n is None or not problem.parameters or any(p.shape != [n] for p in problem.parameters):
        return None
    return n, [p.name for p in problem.parameters]


# Ops a traced norm shows when it subtracts the mean (a LayerNorm); an RMSNorm shows none.
CENTERING_OPS = {"layer_norm", "native_layer_norm", "sub", "var", "var_mean", "group_norm"}


def rmsnorm(problem: Problem) -> list[dict]:
    region = _norm_region(problem)
    ops = traced.plain_ops(problem)
    if region is None or (ops and ops & CENTERING_OPS):
        return []
    return ranked([{"weight": w, "eps": e, "unit_offset": u} for u in unit_offsets(problem)
                   for w in region[1] for e in eps_candidates(problem)])


def unit_offsets(problem: Problem) -> tuple[bool, ...]:
    """Whether the norm scales by 1 + weight (Gemma: `x * (1 + w)`) or by the weight (Llama).
    A traced norm with one add (the eps's) is Llama's. With a second add it may be Gemma's, so
    both are tried, Gemma's first; untraced, both too, Llama's first. The tolerance tells them
    apart (their outputs differ by the whole normalized input)."""
    ops = [o["op"] for o in (problem.graph or {}).get("ops", [])]
    if ops and ops.count("add") < 2:
        return (False,)
    return (True, False) if ops else (False, True)


def layernorm(problem: Problem) -> list[dict]:
    # Offered on an RMSNorm's trace too (after the rmsnorm template): the tolerance rejects it
    # there, and the search keeps one cheap way to show what a wrong fit looks like.
    region = _norm_region(problem)
    if region is None:
        return []
    names = region[1]
    pairs = [(w, b) for w, b in permutations(names, 2)] + [(w, None) for w in names]
    traced_pair = _layer_norm_params(problem)
    if traced_pair in pairs:  # F.layer_norm(x, shape, weight, bias): the trace says which is which
        pairs = [traced_pair]
    return ranked([{"weight": w, "bias": b, "eps": e}
                   for w, b in pairs for e in eps_candidates(problem)])


def _layer_norm_params(problem: Problem) -> tuple[str, str | None] | None:
    """(weight, bias) as the traced layer_norm call took them, when there is exactly one."""
    calls = [o for o in (problem.graph or {}).get("ops", []) if o["op"] in ("layer_norm", "native_layer_norm")]
    if len(calls) != 1:
        return None
    params = [i.partition(":")[2] for i in calls[0].get("in", [])[1:] if i.startswith("param:")]
    return (params[0], params[1] if len(params) > 1 else None) if params else None


def softmax(problem: Problem) -> list[dict]:
    """No parameters, same shape in and out; where traced, a softmax is among its few ops."""
    ops = traced.plain_ops(problem)
    if ops is not None and not ({"softmax", "_softmax"} & ops and len(ops) <= 3):
        return []
    return [{}] if same_shape_io(problem) is not None and not problem.parameters else []


def decoder_layer(problem: Problem) -> list[dict]:
    """Pre-norm residual block: two norm children ([N] weight only) and two mixer children."""
    n = same_shape_io(problem)
    if n is None:
        return []
    norms, mixers = {}, []
    for child in problem.children:
        params = children_params(problem, child)
        if len(params) == 1 and params[0].shape == [n]:
            norms[child] = params[0].name
        elif params:
            mixers.append(child)
    out = []
    for n1, n2 in permutations(norms, 2):
        for m1, m2 in permutations(mixers, 2):
            for e1 in eps_candidates(problem, n1):
                for e2 in eps_candidates(problem, n2):
                    out.append({"norm1": n1, "norm1_w": norms[n1], "eps1": e1, "mixer1": m1,
                                "norm2": n2, "norm2_w": norms[n2], "eps2": e2, "mixer2": m2,
                                **traced.GENERIC})  # the template passes *args, **kwargs to mixer1
    return ranked(out)


def gated_mlp(problem: Problem) -> list[dict]:
    """down(act(gate(x)) * up(x)): two [I, H] weights (either may be the gate) and one [H', I],
    and no other matrices (a region holding more, like a whole decoder layer, is not an MLP).
    The traced graph names gate, up and the activation when it can; shapes guess otherwise."""
    found = traced.gated_mlp(problem)
    if found or (problem.graph or {}).get("matmuls") is not None:
        return found  # traced: the trace knows whether the region's matmuls make this MLP
    io = single_io(problem)
    if io is None:
        return []
    h, h_out = io[0][-1], io[1][-1]
    two_d = [p for p in problem.parameters if len(p.shape) == 2]
    if len(two_d) != 3:
        return []
    out = []
    for inner in sorted({p.shape[0] for p in two_d if p.shape[1] == h}):
        ins = [p.name for p in two_d if p.shape == [inner, h]]
        for g, u in permutations(ins, 2):
            for d in (p.name for p in two_d if p.shape == [h_out, inner] and p.name not in (g, u)):
                for act in GATED_ACTS:
                    out.append({"gate_w": g, "gate_b": bias_for(problem, g, inner),
                                "up_w": u, "up_b": bias_for(problem, u, inner),
                                "down_w": d, "down_b": bias_for(problem, d, h_out), "act": act})
    return ranked(out)


def linear(problem: Problem) -> list[dict]:
    """act(x @ W.T + b): the region's one 2-D parameter is [N_out, K_in]; any [N_out] may be b."""
    io = single_io(problem)
    two_d = [p for p in problem.parameters if len(p.shape) == 2]
    if io is None or len(two_d) != 1 or two_d[0].shape != [io[1][-1], io[0][-1]]:
        return []
    found = traced.linear(problem)
    if found is not None:
        return found
    n = io[1][-1]
    biases = [p.name for p in problem.parameters if p.shape == [n]] + [None]
    return ranked([{"weight": two_d[0].name, "bias": b, "act": act}
                   for b in biases for act in LINEAR_ACTS])


def decode_only(rule):
    """The same rule, for problems whose every workload is decode-shaped (few rows)."""
    def rule_for_decode(problem: Problem) -> list[dict]:
        return rule(problem) if rows(problem) <= DECODE_ROWS else []
    rule_for_decode.__name__ = f"decode_{rule.__name__}"
    return rule_for_decode


def _head_dims(problem: Problem, q_out: int, kv_out: int) -> list[int]:
    attrs = {k: v for k, v in problem.attributes.items()
             if "." not in k and isinstance(v, int) and not isinstance(v, bool) and v > 0}
    if "head_dim" in attrs:
        dims = [attrs["head_dim"]]
    else:
        heads = [v for k, v in attrs.items() if "head" in k and "kv" not in k and "key" not in k]
        dims = [q_out // v for v in heads if q_out % v == 0] or list(HEAD_DIMS)
    return [d for d in dict.fromkeys(dims)
            if d % 2 == 0 and q_out % d == 0 and kv_out % d == 0 and (q_out // d) % (kv_out // d) == 0]


def mlp(problem: Problem) -> list[dict]:
    """proj(act(fc(x))), from the traced graph (which weight comes first, nn.Linear's or
    Conv1D's layout, the activation between), else from shapes: two matrices chaining
    x [.., H] -> [.., I] -> [.., H'] in either layout, every activation guessed."""
    found = traced.mlp(problem)
    if found or (problem.graph or {}).get("matmuls") is not None:
        return found
    io = single_io(problem)
    two_d = [p for p in problem.parameters if len(p.shape) == 2]
    if io is None or len(two_d) != 2:
        return []
    h, h_out = io[0][-1], io[1][-1]
    out = []
    for w1, w2 in permutations(two_d, 2):
        for l1, inner in (("linear", w1.shape[0] if w1.shape[1] == h else None),
                          ("matmul", w1.shape[1] if w1.shape[0] == h else None)):
            for l2, ok in (("linear", w2.shape == [h_out, inner]), ("matmul", w2.shape == [inner, h_out])):
                if inner is None or not ok:
                    continue
                for act, b1, b2 in product(LINEAR_ACTS[1:], biases(problem, w1.name, inner),
                                           biases(problem, w2.name, h_out)):
                    out.append({"w1": w1.name, "b1": b1, "layout1": l1, "w2": w2.name, "b2": b2,
                                "layout2": l2, "act": act})
    return ranked(out)


def attention(problem: Problem) -> list[dict]:
    """x [B, S, H] -> o_proj(SDPA(rope(q_proj x), rope(k_proj x), v_proj x)) with K/V heads
    shared by groups of q heads. From the traced graph when it shows an SDPA call
    (`traced.attention`: transformers' attention with position_embeddings and masks as
    arguments, packed QKV, Conv1D layouts, q/k norms); else from shapes, with rotary tables
    as [positions, head_dim] parameters/buffers and the four weights and two tables all the
    region's matrices (the traced RoPE tables, when known, ordered first)."""
    found = traced.attention(problem)
    if found:
        return found
    io = single_io(problem)
    if io is None or len(io[0]) != 3 or len(io[1]) != 3:
        return []
    h, h_out, seq = io[0][-1], io[1][-1], max(_floats(w.inputs)[0].shape[1] for w in problem.workloads)
    two_d = [p for p in problem.parameters if len(p.shape) == 2]
    if len(two_d) != 6:
        return []
    causal = problem.attributes.get("is_causal")
    causals = (causal,) if isinstance(causal, bool) else (True, False)
    out = []
    for o in (p for p in two_d if p.shape[0] == h_out):
        q_out = o.shape[1]
        for q in (p.name for p in two_d if p.shape == [q_out, h] and p.name != o.name):
            kv_shapes = {tuple(p.shape) for p in two_d if p.shape[1] == h and q_out % p.shape[0] == 0}
            for kv_out, _ in sorted(kv_shapes, reverse=True):
                kvs = [p.name for p in two_d if p.shape == [kv_out, h] and p.name not in (q, o.name)]
                for k, v in permutations(kvs, 2):
                    for hd in _head_dims(problem, q_out, kv_out):
                        tables = [p.name for p in problem.parameters
                                  if len(p.shape) == 2 and p.shape[1] == hd and p.shape[0] >= seq
                                  and p.name not in (q, k, v, o.name)]
                        for cos, sin in permutations(tables, 2):
                            for c in causals:
                                out.append({
                                    "q_w": q, "q_b": bias_for(problem, q, q_out),
                                    "k_w": k, "k_b": bias_for(problem, k, kv_out),
                                    "v_w": v, "v_b": bias_for(problem, v, kv_out),
                                    "o_w": o.name, "o_b": bias_for(problem, o.name, h_out),
                                    "cos": cos, "sin": sin, "head_dim": hd,
                                    "num_heads": q_out // hd, "num_kv_heads": kv_out // hd,
                                    "causal": c, **SHAPE_ATTENTION})
    rope = (problem.graph or {}).get("rope") or {}
    traced_tables = (rope.get("cos", "").partition(":")[2], rope.get("sin", "").partition(":")[2])
    return ranked(sorted(out, key=lambda b: (b["cos"], b["sin"]) != traced_tables))


# What the shape rule's attention always is: separate nn.Linear projections, RoPE from the
# module's own tables, no mask argument, SDPA's default scale, one tensor out.
SHAPE_ATTENTION = {"packed": None, "packed_b": None, "in_layout": "linear", "o_layout": "linear",
                   "q_norm": None, "k_norm": None, "rope": "module", "mask": None, "scale": None, "returns": "T"}

