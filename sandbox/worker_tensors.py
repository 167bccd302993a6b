"""Tensors in the sandbox worker: host copies for the wire, what an output looks like, whether
two runs agree bit for bit, and the fill that makes unwritten outputs visible."""

from __future__ import annotations

import warnings
from typing import Any


class fill_uninitialized:
    """While active, fresh memory from torch.empty & co. is filled: with NaN (deterministic
    mode's fill) for the first run, with a finite sentinel for the others. An output never
    written then reads NaN in one run and not in the other, whatever the allocator hands out
    (on the CPU, malloc may return the first run's NaN-filled block to the second)."""

    SENTINEL = 7777.0

    def __init__(self, torch, nan: bool):
        self.torch, self.nan, self.mode = torch, nan, None

    def __enter__(self):
        torch = self.torch
        if self.nan:
            warnings.filterwarnings("ignore")
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.utils.deterministic.fill_uninitialized_memory = True
            return
        from torch.utils._python_dispatch import TorchDispatchMode
        aten = torch.ops.aten
        empties = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
                   aten.new_empty.default, aten.new_empty_strided.default}
        sentinel = self.SENTINEL

        class FillEmpty(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func in empties and isinstance(out, torch.Tensor) and out.numel():
                    out.fill_(sentinel if (out.is_floating_point() or out.is_complex()) else 77)
                return out

        self.mode = FillEmpty()
        self.mode.__enter__()

    def __exit__(self, *exc):
        if self.nan:
            self.torch.use_deterministic_algorithms(False)
        elif self.mode is not None:
            self.mode.__exit__(*exc)


def plain(out: Any) -> list:
    from tools.region import flatten
    leaves, _ = flatten(out)
    return [None if t is None else plain_tensor(t) for t in leaves]


def plain_tensor(t: Any) -> Any:
    """A plain CPU tensor for the wire (subclasses are reported in the metadata, not sent)."""
    import torch
    return t.detach().as_subclass(torch.Tensor).contiguous().cpu()


def identical(a: list, b: list) -> bool:
    import torch
    return len(a) == len(b) and all(
        (x is None and y is None) or (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                                      and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y))
        for x, y in zip(a, b))


def host(x: Any) -> Any:
    """A host copy of a nested structure of tensors (other leaves kept as they are)."""
    import torch
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, dict):
        return {k: host(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(host(v) for v in x)
    return x


def describe(t: Any) -> dict:
    import torch
    if t is None:
        return {"kind": "none"}
    if type(t) is not torch.Tensor:
        return {"kind": type(t).__name__}
    return {"kind": "tensor", "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
            "device": t.device.type, "stride": list(t.stride())}


def tensors_map(m) -> dict:
    return dict(list(m.named_parameters(remove_duplicate=False)) + list(m.named_buffers(remove_duplicate=False)))
