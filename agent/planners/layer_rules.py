"""The binding rule for a whole pre-norm decoder layer whose MLP the decode GEMV templates fuse
with the post-attention norm and both residual adds (`decode_layer`); the attention child is
called as it is. Kept apart from bindings.py, whose helpers it uses."""

from __future__ import annotations

from itertools import permutations, product

from agent.planners import traced
from agent.planners.bindings import children_params, eps_candidates, ranked
from tools.problem import Problem


def fused_decoder_layer(problem: Problem) -> list[dict]:
    """A pre-norm decoder layer seen whole by the trace: two norm children with one [H] weight
    each, a gated-MLP child (as `traced.gated_mlp` or `packed_gated_mlp` read it) and one other
    child with parameters, the attention, that the template calls as it is (it may write a KV
    cache). The MLP's weights are named so its GEMVs can take norm2 and both residual adds in.
    Whether the norms scale by 1 + w (Gemma) comes from the trace, both forms where it cannot tell."""
    g = problem.graph or {}
    main = next((i for i in g.get("inputs", []) if i.get("kind") == "tensor"
                 and i.get("dtype", "").startswith(("float", "bfloat"))), None)
    if main is None or not main.get("shape") or g.get("returns") != "T":
        return []
    h = main["shape"][-1]
    norms = {c: ps[0].name for c in problem.children if len(ps := children_params(problem, c)) == 1
             and ps[0].shape == [h]}
    mms, shapes = g.get("matmuls") or [], {p.name: p.shape for p in problem.parameters}
    mlps = []
    for child in problem.children:
        own = [mm for mm in mms if mm["weight"].startswith(child + ".")]
        for b in traced.gated_mlp_of(own) or traced.packed_gated_mlp_of(own, shapes, traced.plain_ops(problem)):
            inner = shapes[b["gate_w"]][0] if "gate_w" in b else shapes[b["packed"]][0] // 2
            mlps += [(child, b)] if shapes.get(b["down_w"]) == [h, inner] else []
    if len(norms) != 2:  # Gemma 2's sandwich norms and other arrangements compute something else
        return []
    out = []
    for mixer2, mlp_binding in mlps:
        others = [c for c in problem.children if c not in norms and c != mixer2 and children_params(problem, c)]
        if len(others) != 1:
            continue
        for n1, n2 in permutations(norms, 2):
            for unit in _norm_forms(g.get("ops") or []):
                for e1, e2 in product(eps_candidates(problem, n1), eps_candidates(problem, n2)):
                    out.append({"norm1": n1, "norm1_w": norms[n1], "eps1": e1, "norm2": n2, "norm2_w": norms[n2],
                                "eps2": e2, "mixer1": others[0], "mixer2": mixer2, "unit_offset": unit,
                                **mlp_binding, **traced.GENERIC})  # mixer1 gets the layer's *args, **kwargs
    return ranked(out)


def _norm_forms(ops: list[dict]) -> tuple[bool, ...]:
    """unit_offset values to try: a traced RMSNorm whose rsqrt is followed by an add before the
    next matmul scales by 1 + w (Gemma); one without, by w (Llama); untraced, both."""
    names = [o["op"] for o in ops]
    forms = set()
    for i, op in enumerate(names):
        if op == "rsqrt":
            tail = names[i + 1:]
            stop = next((j for j, t in enumerate(tail) if t in ("linear", "matmul", "mm", "addmm")), len(tail))
            forms.add("add" in tail[:stop])
    return (True,) if forms == {True} else (False,) if forms == {False} else (False, True)
