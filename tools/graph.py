"""What a region computes, from its signature and one traced call: plain facts for planners.

Templates bind by these facts, not by attribute names: which parameter feeds which matmul
(and in which layout: nn.Linear's [out, in] or Conv1D's [in, out]), which activation sits
between two matmuls, where RoPE's cos and sin come from (an input argument such as
transformers' `position_embeddings=(cos, sin)`, or a buffer), where SDPA's mask comes from,
and what the region returns.

The trace runs the region once under a `TorchFunctionMode` that follows every tensor back to
its origin: a parameter or buffer (`param:q_proj.weight`, `buffer:cos_cached`), an input
argument (`input:position_embeddings[0]`), or the op that made it (`op:12`). View-like calls
(view, transpose, slicing, split, dtype casts) keep the origin and add to `via`, so
`cos.unsqueeze(1)` is still the input argument. Everything here is best-effort: a region
that cannot be traced gets only its signature, and planners fall back to shapes.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary

MAX_OPS = 400
"""Ops kept in the facts (the derived facts use all of them)."""
VIEWS = {"view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "__getitem__", "contiguous", "to",
         "float", "half", "bfloat16", "double", "type", "type_as", "expand", "expand_as", "flatten",
         "unflatten", "t", "T", "mT", "narrow", "clone", "detach", "split", "chunk", "unbind", "view_as",
         "reshape_as", "movedim", "swapaxes", "select", "slice"}
MATMULS = {"linear", "addmm", "matmul", "mm", "bmm", "baddbmm", "conv1d", "conv2d", "conv3d", "einsum"}
SDPA = "scaled_dot_product_attention"


# -- the signature -------------------------------------------------------------------------
def signature_facts(cls: type) -> list[dict]:
    """forward's parameters after `self`: name, kind and a literal default ("None", with
    literal False, when the default is not a plain literal), or [] without a signature."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return []
    out = []
    for p in params:
        d = p.default
        literal = d is None or isinstance(d, (bool, int, float, str))
        default = None if d is inspect.Parameter.empty else (repr(d) if literal else "None")
        out.append({"name": p.name, "kind": p.kind.name, "default": default,
                    "literal": d is not inspect.Parameter.empty and literal})
    return out


def render_signature(params: list[dict]) -> str:
    """The parameter list as Python source: `hidden_states, attention_mask=None, **kwargs`."""
    parts, star_done, pos_only = [], False, False
    for p in params:
        kind, text = p["kind"], p["name"] + ("" if p["default"] is None else f"={p['default']}")
        if kind == "POSITIONAL_ONLY":
            pos_only = True
        elif pos_only:
            parts.append("/")
            pos_only = False
        if kind == "VAR_POSITIONAL":
            text, star_done = "*" + p["name"], True
        elif kind == "VAR_KEYWORD":
            text = "**" + p["name"]
        elif kind == "KEYWORD_ONLY" and not star_done:
            parts.append("*")
            star_done = True
        parts.append(text)
    if pos_only:
        parts.append("/")
    return ", ".join(parts)


def argument_names(input_set: dict, params: list[dict]) -> dict[str, str]:
    """Captured argument -> the expression naming it inside a forward with this signature:
    positional i -> its parameter (or `args[j]` past the named ones), keyword k -> k (or
    `kwargs['k']` when it lands in **kwargs). Keys: `arg0`, `arg1`, ... and `kw:name`."""
    positional = [p["name"] for p in params if p["kind"] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
    var_pos = next((p["name"] for p in params if p["kind"] == "VAR_POSITIONAL"), "args")
    var_kw = next((p["name"] for p in params if p["kind"] == "VAR_KEYWORD"), "kwargs")
    named = {p["name"] for p in params if p["kind"] != "VAR_POSITIONAL" and p["kind"] != "VAR_KEYWORD"}
    out = {}
    for i, _ in enumerate(input_set.get("args", [])):
        out[f"arg{i}"] = positional[i] if i < len(positional) else f"{var_pos}[{i - len(positional)}]"
    for k in input_set.get("kwargs", {}):
        out[f"kw:{k}"] = k if k in named else f"{var_kw}[{k!r}]"
    return out


# -- the trace -----------------------------------------------------------------------------
def _name(func: Any) -> str:
    name = getattr(func, "__name__", None) or str(func)
    if name == "__get__":  # a property such as Tensor.T
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name.removeprefix("__").removesuffix("__") if name in ("__matmul__", "__rmatmul__") else name


class _Tracer(TorchFunctionMode):
    def __init__(self, labels: WeakTensorKeyDictionary):
        super().__init__()
        self.labels = labels
        self.nodes: list[dict] = []

    def ref(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            origin, via = self.labels.get(x, ("const", ()))
            return {"from": origin, "via": list(via), "shape": list(x.shape)}
        if isinstance(x, (list, tuple)):
            return [self.ref(v) for v in x]
        return x if x is None or isinstance(x, (bool, int, float, str)) else type(x).__name__

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _name(func)
        leaves = out if isinstance(out, (tuple, list)) else [out]
        if not any(isinstance(t, torch.Tensor) for t in leaves):
            return out
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if name in VIEWS and first is not None:
            origin, via = self.labels.get(first, ("const", ()))
            for i, t in enumerate(leaves):
                if isinstance(t, torch.Tensor):
                    step = f"{name}:{i}" if isinstance(out, (tuple, list)) else name
                    self.labels[t] = (origin, (*via, step))
            return out
        idx = len(self.nodes)
        self.nodes.append({"op": name, "args": [self.ref(a) for a in args],
                           "kwargs": {k: self.ref(v) for k, v in kwargs.items()}})
        for i, t in enumerate(leaves):
            if isinstance(t, torch.Tensor):
                self.labels[t] = (f"op:{idx}", (f"item:{i}",) if isinstance(out, (tuple, list)) else ())
        return out


def trace(region: torch.nn.Module, args: list, kwargs: dict, names: dict[str, str]) -> list[dict]:
    """The region's ops on one call, each with where its tensor operands come from."""
    labels = WeakTensorKeyDictionary()
    for n, p in region.named_parameters(remove_duplicate=False):
        labels[p] = (f"param:{n}", ())
    for n, b in region.named_buffers(remove_duplicate=False):
        labels[b] = (f"buffer:{n}", ())

    def mark(x: Any, expr: str) -> None:
        if isinstance(x, torch.Tensor):
            labels[x] = (f"input:{expr}", ())
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                mark(v, f"{expr}[{i}]")
        elif isinstance(x, dict):
            for k, v in x.items():
                mark(v, f"{expr}[{k!r}]")

    for i, a in enumerate(args):
        mark(a, names.get(f"arg{i}", f"args[{i}]"))
    for k, v in kwargs.items():
        mark(v, names.get(f"kw:{k}", k))
    tracer = _Tracer(labels)
    with torch.no_grad(), tracer:
        type(region).forward(region, *args, **kwargs)  # forward alone, as the sandbox calls it
    return tracer.nodes


def computes(nodes: list[dict]) -> str:
    """A digest of the traced call: every op in order with its operands' origins and shapes and its
    plain arguments (an eps, a scale, a dim), whatever the code's names. Two regions with one digest
    ran the same ops on the same kinds of operands; corpus runs match regions on it (tools/classes.py)."""
    import hashlib
    return hashlib.sha256(repr(nodes).encode()).hexdigest()[:16]


# -- derived facts -------------------------------------------------------------------------
def _operands(node: dict) -> list[dict]:
    flat = []

    def walk(x):
        if isinstance(x, dict) and "from" in x:
            flat.append(x)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(node["args"])
    walk(list(node["kwargs"].values()))
    return flat


def _op(ref: dict | None) -> int | None:
    return int(ref["from"][3:]) if ref and ref["from"].startswith("op:") else None


def _source(ref: Any) -> str | None:
    return ref["from"].split(":", 1)[1] if isinstance(ref, dict) and ":" in ref["from"] else None


def ancestors(nodes: list[dict], idx: int | None) -> set[int]:
    """Every op whose output flows into op `idx` (and idx itself)."""
    seen, stack = set(), [idx] if idx is not None else []
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        stack.extend(j for r in _operands(nodes[i]) if (j := _op(r)) is not None)
    return seen


def matmuls(nodes: list[dict]) -> list[dict]:
    """Matmul-like ops with a parameter operand: its name, layout and bias, in call order."""
    out = []
    for i, n in enumerate(nodes):
        if n["op"] not in MATMULS:
            continue
        ops = _operands(n)
        params = [r for r in ops if r["from"].startswith("param:")]
        if not params:
            continue
        if n["op"] == "linear":
            weight, bias = (ops[1] if len(ops) > 1 else None), (ops[2] if len(ops) > 2 else None)
            layout = "linear"
        elif n["op"] == "addmm":
            bias, weight = ops[0], (ops[2] if len(ops) > 2 else None)
            layout = "linear" if weight and any(v in ("t", "T", "transpose") for v in weight["via"]) else "matmul"
        elif n["op"].startswith("conv"):
            weight, bias, layout = (ops[1] if len(ops) > 1 else None), (ops[2] if len(ops) > 2 else None), "conv"
        else:
            weight, bias = params[-1], None
            layout = "linear" if any(v in ("t", "T", "mT", "transpose") for v in weight["via"]) else "matmul"
        if weight is None or not weight["from"].startswith("param:"):
            continue
        data = next((r for r in ops if r is not weight and r is not bias), None)
        out.append({"op": i, "fn": n["op"], "weight": _source(weight), "layout": layout,
                    "bias": _source(bias) if bias and bias["from"].startswith("param:") else None,
                    "input": data["from"] if data else None, "via": data["via"] if data else []})
    return out


def activation_between(nodes: list[dict], a: int, b: int) -> str | None:
    """The activation applied on the way from op a to op b, when one is recognisable."""
    between = {i for i in ancestors(nodes, b) if i > a and a in ancestors(nodes, i)} - {b}
    names = {nodes[i]["op"] for i in between}
    for i in sorted(between):
        n = nodes[i]
        if n["op"] == "gelu":
            return "gelu_tanh" if n["kwargs"].get("approximate") == "tanh" else "gelu"
    for op, act in (("silu", "silu"), ("relu", "relu"), ("erf", "gelu"), ("tanh", "gelu_tanh")):
        if op in names:
            return act
    if "sigmoid" in names:
        # silu is t * sigmoid(t) of one tensor; n * sigmoid(g) of another is a gated product
        return "silu" if any(_self_gated(nodes, i) for i in between if nodes[i]["op"] == "mul") else "sigmoid"
    return None if names - {"mul", "add", "dropout"} else "none"


def _self_gated(nodes: list[dict], mul: int) -> bool:
    """Op `mul` multiplies a tensor by the sigmoid of that same tensor (x * sigmoid(x))."""
    ops = _operands(nodes[mul])
    for k, ref in enumerate(ops):
        s = _op(ref)
        if s is not None and nodes[s]["op"] == "sigmoid" and not ref["via"] and (x := _operands(nodes[s])):
            others = ops[:k] + ops[k + 1:]
            if any(o["from"] == x[0]["from"] and o["via"] == x[0]["via"] for o in others):
                return True
    return False


def attention_facts(nodes: list[dict], mms: list[dict]) -> dict | None:
    """The SDPA call: which matmuls feed q, k, v (with the split chunk of a packed QKV), the
    mask's origin, is_causal, scale, and the matmul that takes its output."""
    idx = next((i for i, n in enumerate(nodes) if n["op"] == SDPA), None)
    if idx is None:
        return None
    n = nodes[idx]
    ops = n["args"] + [None] * 3
    by_op = {m["op"]: m for m in mms}

    def feeder(ref: dict | None) -> dict:
        found = sorted(ancestors(nodes, _op(ref)) & set(by_op))
        chunk = next((int(v.split(":")[1]) for v in (ref or {}).get("via", []) if v.startswith(("split:", "chunk:"))), None)
        if chunk is None and found:  # a split before the views: look at the op nearest the input
            for i in sorted(ancestors(nodes, _op(ref)), reverse=True):
                chunk = next((int(v.split(":")[1]) for r in _operands(nodes[i]) for v in r["via"]
                              if v.startswith(("split:", "chunk:"))), None)
                if chunk is not None:
                    break
        return {"matmul": by_op[found[-1]]["weight"] if found else None, "chunk": chunk,
                "origin": (ref or {}).get("from")}

    mask = n["kwargs"].get("attn_mask", ops[3] if len(n["args"]) > 3 else None)
    after = [m for m in mms if m["op"] > idx and idx in ancestors(nodes, m["op"])]
    return {"q": feeder(ops[0]), "k": feeder(ops[1]), "v": feeder(ops[2]),
            "mask": _source(mask) if isinstance(mask, dict) else None,
            "mask_origin": mask["from"] if isinstance(mask, dict) else None,
            "is_causal": bool(n["kwargs"].get("is_causal", False)), "scale": n["kwargs"].get("scale"),
            "enable_gqa": bool(n["kwargs"].get("enable_gqa", False)),
            "dropout": float(n["kwargs"].get("dropout_p", ops[4] if isinstance(ops[4], (int, float)) else 0.0) or 0.0),
            "out": after[0]["weight"] if after else None}


def rope_facts(nodes: list[dict], mms: list[dict]) -> dict | None:
    """cos and sin of a rotary embedding: the tables multiplied into q and k (cos with q itself,
    sin with rotate_half(q), which comes out of a `cat`), with where each table comes from."""
    cos, sin, _ = _products(nodes, mms)
    both = sorted(set(cos) & set(sin))
    if not both:
        return None
    pick = both[0]
    return {"cos": cos[pick], "sin": sin[pick], "applied_to": both}


def _products(nodes: list[dict], mms: list[dict]) -> tuple[dict, dict, dict]:
    """Elementwise products of a matmul's output (through any ops) with a table: RoPE's cos
    (times q itself) and sin (times rotate_half(q), a `cat`) when the table is an input or a
    buffer; a norm's weight (Qwen3's q_norm) when it is a parameter. Keyed by the matmul's
    weight; in call order, so a later product (RoPE after a q/k norm) wins."""
    mm_ops = {m["op"]: m["weight"] for m in mms}
    cos, sin, scales = {}, {}, {}
    for n in nodes:
        ops = _operands(n)
        if n["op"] not in ("mul", "__mul__") or len(ops) != 2:
            continue
        for data, table in ((ops[0], ops[1]), (ops[1], ops[0])):
            d, t = _op(data), _op(table)
            if t is not None and nodes[t]["op"] == "add" and len(_operands(nodes[t])) == 1 \
                    and _operands(nodes[t])[0]["from"].startswith("param:"):
                table = _operands(nodes[t])[0]  # a Gemma-style norm's x * (1 + w): w is the norm's weight
            if d is None or not table["from"].startswith(("input:", "buffer:", "param:")):
                continue
            nearest = max(ancestors(nodes, d) & set(mm_ops), default=None)
            if nearest is None:
                continue
            if table["from"].startswith("param:"):
                scales.setdefault(table["from"][6:], mm_ops[nearest])
            else:
                (sin if nodes[d]["op"] == "cat" else cos)[mm_ops[nearest]] = table["from"]
    return cos, sin, scales


def _kind(x: Any) -> dict:
    if isinstance(x, torch.Tensor):
        return {"kind": "tensor", "dtype": str(x.dtype).removeprefix("torch."), "shape": list(x.shape)}
    if isinstance(x, (list, tuple)):
        return {"kind": type(x).__name__, "items": [_kind(v) for v in x]}
    return {"kind": "none" if x is None else type(x).__name__}


def call_facts(input_set: dict, params: list[dict], names: dict[str, str]) -> tuple[list[dict], dict[str, str]]:
    """Each captured argument (key, expression, kind) in call order, and the named parameters
    whose value in this call was None or a bool (given or by default), as Python literals: a
    candidate verified on this call promises nothing for other values of them."""
    given = {f"arg{i}": v for i, v in enumerate(input_set.get("args", []))}
    given.update({f"kw:{k}": v for k, v in input_set.get("kwargs", {}).items()})
    inputs = [{"key": key, "expr": names.get(key, key), **_kind(v)} for key, v in given.items()]
    by_name = {names.get(key, key): v for key, v in given.items()}
    literals = {}
    for p in params:
        if p["kind"] in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            continue
        if p["name"] in by_name:
            v = by_name[p["name"]]
            if v is None or isinstance(v, bool):
                literals[p["name"]] = repr(v)
        elif p["default"] in ("None", "True", "False") and p.get("literal", True):
            literals[p["name"]] = p["default"]  # not a stand-in None for a default we cannot write
    return inputs, literals


def region_facts(region: torch.nn.Module, input_set: dict, structure: str,
                 device: torch.device) -> tuple[dict, list[str]]:
    """Signature, argument names and the traced facts for one frozen input set, plus notes on
    what could not be found out (a region that cannot be traced keeps its signature)."""
    from tools.objects import rebuild
    from tools.region import call_args
    params = signature_facts(type(region))
    names = argument_names(input_set, params)
    inputs, literals = call_facts(input_set, params, names)
    facts: dict[str, Any] = {"signature": params, "arguments": names, "inputs": inputs, "literals": literals,
                             "returns": structure}
    try:
        args, kwargs = call_args(input_set, device)
        nodes = trace(region, rebuild(args), rebuild(kwargs), names)
    except Exception as e:  # a fact for planners, never a reason to lose the problem
        return facts, [f"trace: unknown ({type(e).__name__}: {str(e)[:160]})"]
    mms = matmuls(nodes)
    facts.update(matmuls=mms, attention=attention_facts(nodes, mms), rope=rope_facts(nodes, mms),
                 norm_weights=_products(nodes, mms)[2],
                 ops=[{"op": n["op"], "in": [r["from"] for r in _operands(n)]} for n in nodes[:MAX_OPS]],
                 op_count=len(nodes), computes=computes(nodes))
    for a in mms:  # the next matmul fed by this one, and the activation on the way
        b = next((b for b in mms if b["op"] > a["op"] and a["op"] in ancestors(nodes, b["op"])), None)
        a["feeds"] = b["weight"] if b else None
        a["act"] = activation_between(nodes, a["op"], b["op"]) if b else None
    return facts, []
