"""Tensors in the sandbox workers: host copies for the wire, snapshots a candidate cannot
override, what an output looks like (type, layout, memory it shares), fresh inputs and
perturbed parameters drawn from a seed, and the fill that makes unwritten outputs visible.

Fresh inputs and perturbed parameters are functions of (frozen tensor, seed) drawn on the
tensor's device with a counter-based generator, so the reference worker and a candidate worker
on the same kind of device given the same seed build the same tensors bit for bit, and the
tuner never has to ship them.
"""

from __future__ import annotations

import warnings
from typing import Any

from tools.draws import perturbed, tensors_map, vary, vary_set  # noqa: F401 (the worker and tests call them as T.*)


SENTINEL = 7777.0
"""The finite value freed memory holds on the second verification call of each input set."""


class fill_uninitialized:
    """While active, fresh CPU memory from torch.empty & co. is filled with NaN (torch's own
    deterministic-mode fill): an output never written reads NaN, whatever malloc hands out.

    Only on the CPU: on CUDA the caching allocator hands back the poisoned blocks
    (verify_runs._poison), so no switch is needed. The switch is guarded global
    state for torch.compile, so a compiled candidate compiles once more for this call; what
    must never surround a candidate's call is a Python TorchDispatchMode: dynamo then marks
    the frame as skipped for good and every later call, the timed ones too, runs eager."""

    def __init__(self, torch):
        self.torch, self.before = torch, None

    def __enter__(self):
        torch = self.torch
        warnings.filterwarnings("ignore")
        # The C switch itself: torch.use_deterministic_algorithms also sets inductor's config,
        # importing torch._dynamo (seconds of a worker's start, and it wraps torch functions).
        self.before = (torch.are_deterministic_algorithms_enabled(),
                       torch.is_deterministic_algorithms_warn_only_enabled(),
                       torch.utils.deterministic.fill_uninitialized_memory)
        torch._C._set_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True

    def __exit__(self, *exc):
        mode, warn_only, fill = self.before
        self.torch._C._set_deterministic_algorithms(mode, warn_only=warn_only)
        self.torch.utils.deterministic.fill_uninitialized_memory = fill


class fill_sentinel:
    """While active, fresh memory from torch.empty & co. is filled with SENTINEL (CPU, second
    verification call): malloc does not reliably hand back the poisoned blocks there. A Python
    dispatch mode, so only while torch._dynamo is not loaded: dynamo skips a frame called under
    one for good, and the candidate's compiled code would run eager ever after."""

    def __init__(self, torch):
        self.torch, self.mode = torch, None

    def __enter__(self):
        import sys
        if "torch._dynamo" in sys.modules:
            return
        torch = self.torch
        from torch.utils._python_dispatch import TorchDispatchMode
        aten = torch.ops.aten
        empties = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
                   aten.new_empty.default, aten.new_empty_strided.default}

        class FillEmpty(TorchDispatchMode):
            @classmethod
            def _should_skip_dynamo(cls) -> bool:
                return False  # torch's default wraps the handler for dynamo, importing it (seconds)

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func in empties and isinstance(out, torch.Tensor) and out.numel():
                    out.fill_(SENTINEL if (out.is_floating_point() or out.is_complex()) else 77)
                return out

        self.mode = FillEmpty()
        self.mode.__enter__()

    def __exit__(self, *exc):
        if self.mode is not None:
            self.mode.__exit__(*exc)


# -- what an output is --------------------------------------------------------------------
def is_plain(t: Any) -> bool:
    """A plain torch.Tensor: not a subclass, no Python dispatch, no per-object attribute that
    shadows a Tensor method or property (torch.compile's own annotations are fine)."""
    import torch
    if type(t) is not torch.Tensor:
        return False
    try:
        keys = str(torch._C._dispatch_keys(t))
    except Exception:
        keys = ""
    return "Python" not in keys and not any(hasattr(torch.Tensor, k) for k in t.__dict__)


def snap(t: Any) -> Any:
    """A private copy of a tensor's contents, taken through the dispatcher directly (no Tensor
    method that a candidate could override on one object), dense and contiguous."""
    import torch
    return torch.ops.aten.clone.default(t.detach(), memory_format=torch.contiguous_format)


class Snapshots:
    """`snap` for a timed run's repetitions into copies made before its second call: one set per
    repetition, allocated and written once after the first call, on both sides of a comparison.
    A candidate's run keeps every repetition's copy (it cannot know which one is checked); fresh
    memory for each of those, faulted in inside the next call, made every call on the CPU half
    again slower than the same call in the original's run, which kept one (0.19 against 0.13 ms
    on a small model timed against itself)."""

    def __init__(self, reps: int):
        self.reps, self.slots, self.taken = reps, None, 0

    def rewind(self, reps: int) -> None:
        """Another run, of `reps` repetitions, into the same copies (a CPU worker's next run of the
        same input set: a fresh set of a 256 MB output's copies per run was a tenth of its timing)."""
        self.reps, self.taken = reps, 0
        if self.slots is not None and len(self.slots) < reps:
            self.slots += [None] * (reps - len(self.slots))

    def give_up(self, indices: set[int]) -> None:
        """Those repetitions' copies now belong to the caller: the next run gets new ones."""
        for i in indices:
            if self.slots is not None and 0 <= i < len(self.slots):
                self.slots[i] = None

    def take(self, leaves: list) -> list:
        import torch
        if self.taken == 0:  # right after the run's first call: every repetition's copies reserved now
            self.slots = self.slots or [None] * self.reps
            for j in range(self.reps):
                self.slots[j] = self.slots[j] if self.slots[j] is not None else [_slot(t) for t in leaves]
        i, self.taken = self.taken, self.taken + 1
        slots = self.slots[i] if i < len(self.slots) else []
        out = []
        for k, t in enumerate(leaves):
            if not is_plain(t):
                out.append(None)
                continue
            dst = slots[k] if k < len(slots) else None
            if dst is None or dst.shape != t.shape or dst.dtype != t.dtype or dst.device != t.device:
                out.append(snap(t))  # not shaped like the first repetition's: a copy of its own
            else:
                out.append(torch.ops.aten.copy_.default(dst, t.detach()))
        return out


def _slot(t: Any) -> Any:
    import torch
    if not is_plain(t):
        return None
    dst = torch.ops.aten.empty_like.default(t, memory_format=torch.contiguous_format)
    return torch.ops.aten.zero_.default(dst)  # written now: its pages are not faulted in inside a call


def changed_from(now: Any, before: Any) -> bool:
    """Whether the tensors of `now` (on the device) differ from `before` (the same structure, on the
    host or the device), compared where `now` lives: a host copy of a KV cache costs seconds."""
    import torch
    if isinstance(now, torch.Tensor):
        return not (isinstance(before, torch.Tensor) and now.shape == before.shape and now.dtype == before.dtype
                    and same_bits(now, before.to(now.device)))
    if isinstance(now, dict):
        return not isinstance(before, dict) or now.keys() != before.keys() or any(
            changed_from(now[k], before[k]) for k in now)
    if isinstance(now, (list, tuple)):
        return not isinstance(before, (list, tuple)) or len(now) != len(before) or any(
            changed_from(a, b) for a, b in zip(now, before))
    return False


def same_bits(a: Any, b: Any) -> bool:
    """Whether two tensors hold the same bytes (NaN payloads and signed zeros included)."""
    import torch
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if not a.numel():
        return True
    view, x, y = torch.ops.aten.view.dtype, _dense(a), _dense(b)
    for dtype in (torch.int64, torch.int32, torch.int16):
        try:
            return bool(torch.ops.aten.equal.default(view(x, dtype), view(y, dtype)))
        except RuntimeError:  # a size or offset that is not a multiple of that width
            continue
    return bool(torch.ops.aten.equal.default(view(x, torch.uint8), view(y, torch.uint8)))


def _dense(t: Any) -> Any:
    """`t` flattened, viewed in place where it is dense (two fresh copies of a 256 MB output per
    comparison, their pages faulted in, were most of a CPU verification's time), compared as the
    widest integers its bytes divide into; through the dispatcher, no Tensor method of `t` called."""
    import torch
    aten = torch.ops.aten
    # A conjugate or negative view (`.conj()`) is its bits only once resolved: they cannot be viewed.
    t = aten.resolve_neg.default(aten.resolve_conj.default(t))
    if not aten.is_contiguous.default(t):
        t = aten.clone.default(t, memory_format=torch.contiguous_format)
    return aten.reshape.default(t, [-1])


def span(t: Any) -> tuple[int, int]:
    """(start, end) of the memory a tensor's storage covers."""
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def shares_memory(t: Any, spans: list[tuple[int, int]]) -> bool:
    a, b = span(t)
    return a != b and any(a < e and s < b for s, e in spans)


def spans_of(obj: Any) -> list[tuple[int, int]]:
    return [span(t) for t in tensors(obj) if t.numel()]


def tensors(obj: Any):
    import torch
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors(v)


def describe(t: Any) -> dict:
    import torch
    if t is None:
        return {"kind": "none"}
    if not isinstance(t, torch.Tensor):
        return {"kind": type(t).__name__}
    if not is_plain(t):
        return {"kind": f"{type(t).__name__} (not a plain torch.Tensor)"}
    return {"kind": "tensor", "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
            "device": t.device.type, "stride": list(t.stride()), "requires_grad": bool(t.requires_grad)}


# -- the wire -----------------------------------------------------------------------------
def plain_tensor(t: Any) -> Any:
    """A plain CPU tensor for the wire: `t` itself where it is one already, dense (the wire
    sends its bytes; a copy of a 256 MB output per call was a tenth of a CPU verification)."""
    import torch
    if type(t) is torch.Tensor and t.device.type == "cpu" and torch.ops.aten.is_contiguous.default(t):
        return torch.ops.aten.detach.default(t)
    return torch.ops.aten._to_copy.default(t.detach(), device=torch.device("cpu")).contiguous()


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


def identical(a: list, b: list) -> bool:
    import torch
    return len(a) == len(b) and all(
        (x is None and y is None) or (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                                      and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y))
        for x, y in zip(a, b))


# -- drawn from a seed --------------------------------------------------------------------
def fresh_set(p: dict, args: list, kwargs: dict, seed: int) -> tuple[list, dict]:
    """A fresh input set for registered problem `p` (a worker's): its integer inputs kept as
    frozen where the freeze found they must be (Problem.fixed_ints)."""
    return vary_set(args, kwargs, seed, p.get("fixed_ints", False))


class WrittenInPlace:
    """Fresh input sets for timed repetitions in which an input the call writes into (a KV
    cache) keeps one address from the second repetition on, its fresh values copied in: a served
    model's cache lives at a fixed address, and CUDA graphs (reduce-overhead) re-record for
    every new one. Every other input is new memory each repetition. Both workers draw alike."""

    def __init__(self, draw):
        self.draw, self.last, self.versions, self.kept = draw, [], [], {}

    def __call__(self, j: int) -> Any:
        fresh = self.draw(j)
        leaves = list(tensors(fresh))
        for k, (t, v) in enumerate(zip(self.last, self.versions)):
            if k not in self.kept and t._version != v:  # written by the last call: kept from now on
                self.kept[k] = t
        if self.kept:
            fresh = _swap(fresh, {id(leaves[k]): buf for k, buf in self.kept.items() if k < len(leaves)
                                  and buf.shape == leaves[k].shape and buf.dtype == leaves[k].dtype})
            leaves = list(tensors(fresh))
        self.last, self.versions = leaves, [t._version for t in leaves]
        return fresh


def _swap(x: Any, into: dict) -> Any:
    """`x` with each tensor whose id is in `into` copied into that buffer, which stands in for it."""
    import torch
    if isinstance(x, torch.Tensor):
        buf = into.get(id(x))
        return x if buf is None else buf.copy_(x)
    if isinstance(x, dict):
        return {k: _swap(v, into) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_swap(v, into) for v in x)
    return x


