"""Declared in-place outputs: arguments a region writes into, such as a KV cache.

A region class lists them in `inplace_outputs` (names of its forward's parameters). The freeze
records their state *before* the call (tools/recording.py) and writes down where they sit in
the frozen input set (`Problem.inplace_inputs`: "args.1", "kwargs.k_cache"). After a candidate's
call, the parent judges what it left in its inputs against the original's post-call inputs:

- a declared argument must hold, where the original wrote, what the original wrote (within the
  tolerance: a cache left stale fails), and must keep, bit for bit, every position (vector along
  the last dim) the original left as it was (writing other cache positions fails);
- every other argument must come back bit-identical to the original's.
"""

from __future__ import annotations

from typing import Any

import torch

from tools.modelfile import tensors_in
from tools.objects import is_marker
from tools.trial import Status


def inplace_paths(names: list[str], declared: set[str], input_set: dict) -> list[str]:
    """Where the declared arguments are in one frozen input set ({"args", "kwargs"}), and every
    cache object frozen in it (tools/objects.py: a cache is written by the call, declared or not)."""
    paths = [f"args.{i}" for i, a in enumerate(input_set.get("args", []))
             if (i < len(names) and names[i] in declared and isinstance(a, torch.Tensor)) or is_marker(a)]
    return paths + [f"kwargs.{k}" for k, v in input_set.get("kwargs", {}).items()
                    if (k in declared and isinstance(v, torch.Tensor)) or is_marker(v)]


def _at(input_set: Any, path: str) -> Any:
    kind, _, key = path.partition(".")
    try:
        return input_set[kind][int(key)] if kind == "args" else input_set[kind][key]
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def _top_level(input_set: Any) -> list[str]:
    if not isinstance(input_set, dict):
        return []
    return ([f"args.{i}" for i in range(len(input_set.get("args", [])))]
            + [f"kwargs.{k}" for k in input_set.get("kwargs", {})])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def _same_bits(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and torch.equal(_bytes(a), _bytes(b.to(a.device))))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_bits(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_bits(a[k], b[k]) for k in a)
    return a == b


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as one row per position (a vector along the last dim)."""
    width = t.shape[-1] * t.element_size() if t.dim() > 1 else t.element_size()
    return _bytes(t).view(-1, width)


def check(paths: list[str], got: Any, original: Any, before: Any, tol, diff
          ) -> tuple[Status, str, Any] | None:
    """None when the candidate's post-call inputs `got` match the original's `original` as the
    module docstring says; else (status, reason, the Diff that failed the tolerance or None). `before` is the frozen (pre-call) input set;
    `diff` is tools.verify.diff (passed in: verify imports this module)."""
    for path in _top_level(original):
        g, o = _at(got, path), _at(original, path)
        if path not in paths:
            if not _same_bits(g, o):
                return Status.mutated_input, f"argument {path} changed, and it is not a declared in-place output", None
            continue
        b = _at(before, path)
        if is_marker(o):  # a cache object: each of its tensors, as one declared output
            bad = _tensor_check(path, list(tensors_in(g)), list(tensors_in(o)), list(tensors_in(b)), tol, diff)
        else:
            bad = _tensor_check(path, [g], [o], [b], tol, diff)
        if bad is not None:
            return bad
    return None


def _tensor_check(path: str, gs: list, os_: list, bs: list, tol, diff) -> tuple[Status, str, Any] | None:
    """One declared output's tensors (a cache object's, in order), as `check` says."""
    if len(gs) != len(os_):
        return Status.wrong, f"in-place output {path} came back with other tensors", None
    for g, o, b in zip(gs, os_, bs + [None] * (len(os_) - len(bs))):
        if not isinstance(g, torch.Tensor) or g.shape != o.shape or g.dtype != o.dtype:
            return Status.wrong, f"in-place output {path} came back with another shape or dtype", None
        if isinstance(b, torch.Tensor) and b.shape == o.shape and b.dtype == o.dtype and o.numel():
            # Row-wise on the bytes, without copies of the (large) cache: which positions the
            # original wrote, and whether the candidate left every other one as it was.
            o_rows, b_rows, g_rows = _rows(o), _rows(b.to(o.device)), _rows(g.to(o.device))
            written = (o_rows != b_rows).any(dim=1)
            moved = (g_rows != b_rows).any(dim=1) & ~written
            if bool(moved.any()):
                return Status.mutated_input, (f"in-place output {path}: {int(moved.sum())} positions the original "
                                              "leaves as they were are changed (written at the wrong positions)"), None
            shape = (-1, o.shape[-1]) if o.dim() > 1 else (-1,)
            d = diff([g.reshape(shape)[written]], [o.reshape(shape)[written]])
        else:
            d = diff([g], [o])
        if d.bad_nonfinite or d.error(tol) > tol.value:
            return Status.wrong, (f"in-place output {path} differs from what the original writes by "
                                  f"{d.error(tol):.3g} (tolerance {tol}): left stale or written wrong"), d
    return None
