"""Bindings for attention fed by a transformers Cache object: the region takes the model's
cache (`Problem.inplace_inputs == ["kwargs.cache"]`), writes this call's keys and values into
it with `cache.update(k, v, layer_idx, ...)` and attends over what the update returns, under the
mask transformers passes (None at a prefill, where SDPA runs `is_causal`; a bool or additive
float mask otherwise).

The projections, q/k norms, RoPE's origin and the scale come from the trace, through
`traced.attention` (the rule `gqa_attention` binds by). What the trace of one input set cannot
show, the workloads do: which mask each call passed (found at its argument's place among the
flattened inputs), so the candidate is bound to exactly those forms. Variants from the module's
attributes: `sliding_window`, logit soft-capping (`attn_logit_softcapping`, `softcap`).

No binding (`refusal` says why) for:
- no cache layer index (`layer_idx`), or a cache the region does not take as an argument;
- a trace without an SDPA call these projections feed (`traced.attention` finds none);
- RoPE from the module's own tables (positions would have to be looked up: not done here);
- dropout in the traced SDPA call (a region frozen in training mode);
- a mask that is not a 4-D [B or 1, heads or 1, S or 1, keys] bool or float tensor (a per-KV-head
  or other rank mask, an integer mask), or masks whose place among the inputs is ambiguous.
The candidate raises on any other mask form at call time (`_check_mask` in the template).
"""

from __future__ import annotations

from agent.planners import traced
from agent.planners.kv_cache import arg_name
from tools.problem import Problem

MASK_DTYPES = ("bool", "float16", "bfloat16", "float32", "float64")
SOFTCAP_ATTRS = ("attn_logit_softcapping", "softcap", "logit_softcapping")


def cache_fed_attention(problem: Problem) -> list[dict]:
    found = _bind(problem)
    return found if isinstance(found, list) else []


def refusal(problem: Problem) -> str | None:
    """Why `cache_fed_attention` gives no binding for this problem (None: it gives some)."""
    found = _bind(problem)
    return found if isinstance(found, str) else None


def refusal_for_cache_fed(problem: Problem) -> str | None:
    """`refusal`, for attention modules fed a transformers Cache object only (one in-place input, a
    traced SDPA call, head counts among the module's own attributes: not a decoder layer around
    one); None for any other region."""
    heads = any("head" in k and "." not in k and isinstance(v, int) for k, v in problem.attributes.items())
    if len(problem.inplace_inputs) != 1 or not (problem.graph or {}).get("attention") or not heads:
        return None
    return refusal(problem)


def _count(item: dict) -> int | None:
    """Tensors an argument flattens to (None: a frozen object, whose count the inputs tell)."""
    kind = item.get("kind")
    if kind in ("tuple", "list"):
        counts = [_count(i) for i in item.get("items", [])]
        return None if None in counts else sum(counts)
    return {"tensor": 1, "dict": None}.get(kind, 0)


def mask_forms(problem: Problem, mask: str) -> list[tuple[str, list[int], str] | None] | str:
    """Per workload, the mask it passed as (dtype, shape, workload name), or None for no mask; a
    string saying why the masks cannot be told apart. The mask sits at its argument's place among
    each workload's flattened inputs: the traced input set says which arguments come before it, and
    how many tensors the one frozen object (the cache) stands for."""
    g = problem.graph or {}
    items = g.get("inputs") or []
    slot = next((k for k, i in enumerate(items) if i.get("expr") == mask), None)
    if slot is None:
        return f"the mask argument {mask!r} is not among the traced inputs"
    counts = [_count(i) for i in items]
    if counts.count(None) > 1:
        return "more than one frozen object among the inputs: the mask's place is ambiguous"
    first = items[0].get("shape") if items else None
    traced_w = next((w for w in problem.workloads if w.inputs and w.inputs[0].shape == first), None)
    if traced_w is None:
        return "no workload matches the traced input set"
    known = sum(c for c in counts if c is not None)
    obj = len(traced_w.inputs) - known
    before = sum(obj if c is None else c for c in counts[:slot])
    plain = len(traced_w.inputs) - counts[slot]  # tensors of a call without a mask
    out = []
    for w in problem.workloads:
        extra = len(w.inputs) - plain
        if extra not in (0, 1) or (extra and before >= len(w.inputs)):
            return f"workload {w.name}: cannot tell which input is the mask"
        spec = w.inputs[before] if extra else None
        out.append((spec.dtype, spec.shape, w.name) if spec else None)
    return out


def _check_forms(forms: list, problem: Problem, heads: int) -> str | None:
    for form, w in zip(forms, problem.workloads):
        if form is None:
            continue
        dtype, shape, name = form
        b, s = w.inputs[0].shape[0], w.inputs[0].shape[1]
        if dtype not in MASK_DTYPES:
            return f"workload {name}: a {dtype} mask (only bool or additive float masks are read)"
        if len(shape) != 4:
            return f"workload {name}: a {len(shape)}-D mask {shape} (the kernels read [B, heads, S, keys])"
        if shape[0] not in (1, b) or shape[1] not in (1, heads) or shape[2] not in (1, s):
            return (f"workload {name}: mask {shape} does not broadcast as [B or 1, {heads} heads or 1, "
                    f"S or 1, keys] over B={b}, S={s}")
    return None


def _bind(problem: Problem) -> list[dict] | str:
    if len(problem.inplace_inputs) != 1:
        return "not one in-place input (a transformers Cache object)"
    g = problem.graph or {}
    params = g.get("signature") or []
    names = [p["name"] for p in params]
    cache = arg_name(problem.inplace_inputs[0], names)
    if cache is None or cache not in names:
        return "the in-place input is not an argument of the region's signature"
    layer = problem.attributes.get("layer_idx")
    if not isinstance(layer, int) or isinstance(layer, bool):
        return "no layer_idx attribute: which layer of the cache to update is unknown"
    found = traced.attention(problem)
    if not found:
        return "the trace shows no SDPA call fed by projections this template computes"
    base = found[0]
    if base["rope"] == "module":
        return "RoPE from the module's own tables (not position_embeddings): not supported over a cache"
    a = g.get("attention") or {}
    if a.get("dropout"):
        return f"dropout {a['dropout']} in the traced attention (frozen in training mode)"
    mask = (base["mask"] if base["mask"] else
            next((n for n in names if "mask" in n.lower() and "encoder" not in n.lower()), None))
    forms = mask_forms(problem, mask) if mask else [None] * len(problem.workloads)
    if isinstance(forms, str):
        return forms
    if why := _check_forms(forms, problem, base["num_heads"]):
        return why
    if not mask and any(forms):
        return "a mask among the inputs but no mask argument"
    attrs = problem.attributes
    scale = base["scale"] if isinstance(base["scale"], float) else attrs.get("scaling")
    softcap = next((float(attrs[k]) for k in SOFTCAP_ATTRS if isinstance(attrs.get(k), (int, float))
                    and not isinstance(attrs.get(k), bool) and attrs[k] > 0), None)
    window = attrs.get("sliding_window")
    window = window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None
    arguments = g.get("arguments") or {}
    guards = [gd for gd in (traced.call_vars(problem) or traced.GENERIC)["guards"] if gd[0] not in (mask, cache)]
    return [{**base, "guards": guards, "cache": cache, "layer_idx": layer, "mask": mask,
             "mask_dtypes": sorted({f[0] for f in forms if f}), "mask_none": None in forms,
             "scale": float(scale) if isinstance(scale, (int, float)) else None, "softcap": softcap,
             "window": window, "positions": arguments.get("kw:cache_position"), "causal": True}]
