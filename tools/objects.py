"""Objects a region is called with that hold its state in tensors: transformers' KV caches.

transformers passes each attention layer the model's cache object (`StaticCache`, its layers'
keys and values and write position as tensors) and the layer writes its new keys and values
into it. A frozen input set is plain data (tools/recording.py), so such an object is frozen as a
marker, `{"__object__": "transformers.cache_utils.StaticCache", "state": {...}}`, its attributes
as plain data (tensors, numbers, lists of its layer objects, ...), and rebuilt at the call
(`as_called`) around the very tensors of the input set: everything that draws, moves, copies or
compares inputs sees plain tensors in dicts, and the call sees the cache transformers passes.

Only classes of the modules in `ALLOWED` are rebuilt (named, imported and filled, never
unpickled); any other object stays "not plain data".
"""

from __future__ import annotations

from typing import Any, Callable

import torch

OBJECT = "__object__"
ALLOWED = ("transformers.cache_utils",)
"""Modules whose objects are frozen as markers: transformers' caches and their layers."""


def frozen_kind(x: Any) -> str | None:
    """`module.Class` of an object frozen as a marker, or None for anything else."""
    cls = type(x)
    if cls.__module__ in ALLOWED and hasattr(x, "__dict__") and not isinstance(x, type):
        return f"{cls.__module__}.{cls.__qualname__}"
    return None


DEVICE = "__device__"
"""A device attribute's value in a marker: the device of the object's tensors when rebuilt (a
device does not cross the sandbox's wire, and the set is called on the device it is moved to)."""


def marker(x: Any, plain: Callable[[Any, str], Any], where: str) -> dict:
    """`x` as a marker: its attributes each as `plain` makes them (called back for nesting), a
    dtype by its name and a device as DEVICE."""
    def one(k: str, v: Any) -> Any:
        if isinstance(v, torch.device):
            return DEVICE
        if isinstance(v, torch.dtype):
            return {"__dtype__": str(v).removeprefix("torch.")}
        return plain(v, f"{where}.{k}")
    return {OBJECT: frozen_kind(x), "state": {k: one(k, v) for k, v in vars(x).items()}}


def is_marker(x: Any) -> bool:
    return isinstance(x, dict) and isinstance(x.get(OBJECT), str) and isinstance(x.get("state"), dict)


def holds_marker(x: Any) -> bool:
    if is_marker(x):
        return True
    if isinstance(x, (list, tuple)):
        return any(holds_marker(v) for v in x)
    if isinstance(x, dict):
        return any(holds_marker(v) for v in x.values())
    return False


def rebuild(x: Any) -> Any:
    """`x` with every marker made the object again, around the same tensors (no copy)."""
    if is_marker(x):
        module, _, name = x[OBJECT].rpartition(".")
        if module not in ALLOWED:
            raise ValueError(f"{x[OBJECT]}: only objects of {', '.join(ALLOWED)} are rebuilt")
        import importlib
        cls = getattr(importlib.import_module(module), name)
        obj = cls.__new__(cls)
        state = {k: rebuild(v) for k, v in x["state"].items()}
        where = next((t.device for t in state.values() if isinstance(t, torch.Tensor)), torch.device("cpu"))
        for k, v in state.items():
            if isinstance(v, str) and v == DEVICE:  # follows the object's tensors (frozen on the CPU, called on a GPU)
                state[k] = where
            elif isinstance(v, dict) and set(v) == {"__dtype__"}:
                state[k] = getattr(torch, v["__dtype__"])
        obj.__dict__.update(state)
        return obj
    if isinstance(x, (list, tuple)):
        return type(x)(rebuild(v) for v in x)
    if isinstance(x, dict):
        return {k: rebuild(v) for k, v in x.items()}
    return x


def as_called(fwd: Callable) -> Callable:
    """`fwd(module, *args, **kwargs)` with the markers in its arguments rebuilt first."""
    def call(module, *args, **kwargs):
        if holds_marker(args) or holds_marker(kwargs):
            args, kwargs = rebuild(list(args)), rebuild(dict(kwargs))
        return fwd(module, *args, **kwargs)
    call.__wrapped__ = fwd
    return call
