"""The roofline floor of one call: the bytes it must move and the FLOPs it must compute, at the
device's measured ceilings. A lower bound: a candidate faster than 0.9x of it is refused as
impossible (sandbox/timed.py), and the report gives each way's fraction of it. So it counts
only what no kernel can skip:

- of each input and weight, what the call's ops touched: a transformers cache holds every
  layer's keys and values, and one layer's attention reads its own; an embedding table is read
  at the rows looked up, not whole. Per storage, the largest view any op read or wrote (a
  table gathered from: the rows gathered; a buffer scattered into: the values written);
- attention as its FLOPs go: half for a causal call, the share of keys a mask lets through,
  and grouped-query attention counted per query head (torch's own formulas assert on it).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

aten = torch.ops.aten

GATHERS = {aten.embedding, aten.index_select, aten.gather, aten.index, aten.take, aten._embedding_bag,
           aten.embedding_bag}
"""Ops that read their first argument (a table) at the rows an index names: they touch what they
return, not the table."""
SCATTERS = {aten.index_copy, aten.index_copy_, aten.index_put, aten.index_put_, aten._index_put_impl_,
            aten.scatter, aten.scatter_, aten.scatter_add, aten.scatter_add_, aten.scatter_reduce,
            aten.scatter_reduce_, aten.index_add, aten.index_add_}
"""Ops that write their first argument (a buffer, a KV cache) at the rows an index names: they
touch as much of it as the values they write."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def storage(t: torch.Tensor) -> tuple | None:
    try:
        s = t.untyped_storage()
    except Exception:  # sparse, nested, tensor subclasses without one
        return None
    return (str(t.device), s.data_ptr()), s.nbytes()


class Touched(TorchDispatchMode):
    """Per storage of the tracked tensors, what the call's ops read or wrote of it: per view (its
    offset, sizes and strides) the most one op touched, the views summed (one layer's cache of
    a cache tensor that holds every layer's is one view), at most the storage."""

    def __init__(self, tracked: Iterable[torch.Tensor]):
        super().__init__()
        self.size = dict(s for t in tracked if isinstance(t, torch.Tensor) and (s := storage(t)) and s[1])
        self.views: dict[tuple, dict[tuple, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "is_view", False):  # a view moves no data: what reads it counts
            return out
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        op = func.overloadpacket
        indexed = None
        if op in GATHERS:
            indexed = sum(_nbytes(o) for o in tree_leaves(out) if isinstance(o, torch.Tensor))
        elif op in SCATTERS and len(leaves) > 1:
            indexed = max(_nbytes(t) for t in leaves[1:])
        for i, t in enumerate(leaves):
            if (s := storage(t)) is None or s[0] not in self.size:
                continue
            n = indexed if (indexed is not None and i == 0) else _nbytes(t)
            views = self.views.setdefault(s[0], {})
            view = (t.storage_offset(), tuple(t.shape), tuple(t.stride()))
            views[view] = max(views.get(view, 0), n)
        return out

    def nbytes(self) -> int:
        return sum(min(self.size[k], sum(v.values())) for k, v in self.views.items())


def _attention_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask) -> int:
    """Q·K^T and P·V for every query head (grouped K/V heads read once per query head's group)."""
    *batch, lq, d = q.shape
    lk, dv = k.shape[-2], v.shape[-1]
    n = 1
    for b in batch:
        n *= b
    flops = 2 * n * lq * lk * (d + dv)
    if causal:
        return flops // 2
    if isinstance(mask, torch.Tensor) and mask.numel():
        allowed = mask if mask.dtype == torch.bool else mask > -float("inf")
        return int(flops * float(allowed.float().mean()))
    return flops


def attention_formulas() -> dict:
    """FlopCounterMode formulas for the fused attention ops: (op, index of is_causal, index of
    the mask or None) per schema."""
    ops = [(aten._scaled_dot_product_flash_attention.default, 4, None),
           (aten._scaled_dot_product_efficient_attention.default, 6, 3),
           (aten._scaled_dot_product_cudnn_attention.default, 6, 3),
           (aten._scaled_dot_product_flash_attention_for_cpu.default, 4, 6)]
    out = {}
    for op, causal_at, mask_at in ops:
        def formula(*args, out_val=None, _c=causal_at, _m=mask_at, **kwargs):
            causal = args[_c] if len(args) > _c else kwargs.get("is_causal", False)
            mask = (args[_m] if len(args) > _m else kwargs.get("attn_mask", kwargs.get("attn_bias"))) \
                if _m is not None else None
            return _attention_flops(args[0], args[1], args[2], bool(causal), mask)
        formula._get_raw = True  # tensors as they are: the mask's values, not its shape
        out[op.overloadpacket] = formula
    return out


def measure(call: Callable[[], object], tracked: list[torch.Tensor], notes: list[str]) -> tuple[int | None, int | None]:
    """(bytes of `tracked` the call touched, FLOPs) from one call under both counters; where the
    FLOP counter fails (it asserts on some attention calls), the bytes from a call of their own.
    None for what could not be counted, with a note."""
    touched = Touched(tracked)
    counter = FlopCounterMode(display=False, custom_mapping=attention_formulas())
    try:
        with torch.no_grad(), counter, touched:
            call()
        return touched.nbytes(), counter.get_total_flops()
    except Exception as e:
        notes.append(f"FLOP count: unknown ({type(e).__name__}: {str(e)[:120]}); the floor counts bytes only")
    touched = Touched(tracked)
    try:
        with torch.no_grad(), touched:
            call()
        return touched.nbytes(), None
    except Exception as e:
        notes.append(f"roofline floor: the bytes the call touches unknown ({type(e).__name__}: {str(e)[:120]}); "
                     "it counts every input and weight whole")
        return None, None
