"""What candidate code must leave as it found it, and the check that it did.

A snapshot, taken in the worker before any candidate code runs and compared after each
candidate phase, covers:

- functions of torch, torch.nn.functional, Tensor (dunders included), Module, torch.cuda and
  its Event, the C variable functions, `time`, `statistics`, `json`, `socket.socket`, the
  harness's own modules (worker, protocol, verification runs, timing, tensor helpers and fresh draws), and
  the region's own classes: by identity AND by code object, so a `__code__` swap shows as well
  as a replaced attribute;
- the dispatcher: the kernel table of the aten ops regions and the harness use most (a slow
  `aten::rsqrt` registered through `torch.library` changes it; torch.compile's own
  registrations do not), and torch function / dispatch modes left pushed;
- global state a candidate could flip to change numerics or speed: default dtype, threads,
  grad and inference mode, autocast, TF32 and reduced-precision flags, matmul precision,
  cuDNN flags, deterministic mode, SDPA backends, denormal flushing;
- profiling and tracing hooks (`sys.setprofile`, `sys.settrace`, and their threading forms).

One change is torch's own and accepted: the wrappers dynamo installs around torch functions
when an honest candidate's torch.compile first imports it (`torch._disable_dynamo` on
`manual_seed`, the mutation guard on `Module.__init__` and `__setstate__`). A changed function
passes only if its code equals a nested function of those torch files, compiled here from
their read-only source (so a candidate cannot pass its own code off as theirs), and every
function it closes over is the original. The worker is spared dynamo's import (seconds of each
start) until a candidate needs it.

This runs in the candidate's own process, so it is a second line: what decides is outside
it. The baseline is timed in a process that never runs candidate code, outputs are judged in
the tuner, and claimed times are bounded by the tuner's own clock (sandbox/runner.py).
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

HARNESS_OPS = ("aten::clone", "aten::copy_", "aten::empty.memory_format", "aten::empty_strided",
               "aten::empty_like", "aten::fill_.Scalar", "aten::zero_", "aten::_to_copy", "aten::equal",
               "aten::roll", "aten::mul.Tensor", "aten::add.Tensor", "aten::randn", "aten::normal_",
               "aten::view", "aten::reshape", "aten::sub.Tensor", "aten::abs", "aten::max")
COMPUTE_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::rsqrt",
               "aten::pow.Tensor_Scalar", "aten::mean.dim", "aten::_softmax", "aten::silu", "aten::gelu",
               "aten::native_layer_norm", "aten::convolution", "aten::_scaled_dot_product_flash_attention",
               "aten::_scaled_dot_product_efficient_attention", "aten::scaled_dot_product_attention",
               "aten::cat", "aten::mul.Tensor", "aten::add.Tensor", "aten::sum.dim_IntList")
"""The aten ops regions compute with most, whose kernels a candidate must leave registered as they
were (the worker checks them, `Worker.tampered`, for its verification runs too)."""


def _spaces(classes: list[type]) -> dict[str, Any]:
    import socket
    import torch
    import torch.nn.functional as F
    from sandbox import protocol, verify_runs, worker_tensors
    from tools import draws, timing
    spaces = {"torch": torch, "F": F, "Tensor": torch.Tensor, "TensorBase": torch._C.TensorBase,
              "Module": torch.nn.Module, "cuda": torch.cuda, "VF": torch._C._VariableFunctions,
              "nn": torch._C._nn, "timing": timing, "time": time, "statistics": statistics,
              "worker_tensors": worker_tensors, "draws": draws, "Parameter": torch.nn.Parameter, "protocol": protocol,
              "verify_runs": verify_runs, "socket": socket.socket, "json": __import__("json")}
    worker = sys.modules.get("__main__")
    if worker is not None and hasattr(worker, "Worker"):  # the running worker's own module and class
        spaces["worker"], spaces["Worker"] = worker, worker.Worker
    if hasattr(torch.cuda, "Event"):
        spaces["cuda.Event"] = torch.cuda.Event
    spaces.update({f"{c.__module__}.{c.__qualname__}": c for c in classes})
    return spaces


def _fingerprint(value: Any) -> tuple:
    code = getattr(value, "__code__", None)
    func = getattr(value, "__func__", None)  # classmethod / staticmethod wrappers
    if code is None and func is not None:
        code = getattr(func, "__code__", None)
    return (id(value), id(code) if code is not None else 0)


TORCH_WRAPPER_SOURCES = ("_compile.py", "_dynamo/mutation_guard.py")
"""torch's files (relative to its package) whose nested functions wrap torch's own functions."""


class Snapshot(dict):
    """Fingerprints by name, and the objects they were taken of (held, so no id is reused)."""
    originals: dict[str, Any]


def _objects(classes: list[type]) -> dict[str, Any]:
    objects = {}
    for label, space in _spaces(classes).items():
        raw = getattr(space, "__dict__", None)
        # The raw namespace where there is one: bound methods are new objects on every access.
        names = dict(raw) if raw is not None else {n: getattr(space, n, None) for n in dir(space)
                                                  if not n.startswith("__")}
        for name, value in names.items():
            if name in ("__dict__", "__weakref__", "__doc__", "_abc_impl"):
                continue
            objects[f"{label}.{name}"] = value
    return objects


def functions(classes: list[type]) -> dict[str, tuple]:
    return {k: _fingerprint(v) for k, v in _objects(classes).items()}


def torch_wrapper_codes() -> list[types.CodeType]:
    """Every nested function of TORCH_WRAPPER_SOURCES, compiled from torch's files on disk."""
    import torch
    root, codes = Path(torch.__file__).parent, []
    for rel in TORCH_WRAPPER_SOURCES:
        try:
            top = compile((root / rel).read_text(), str(root / rel), "exec", dont_inherit=True)
        except (OSError, SyntaxError, ValueError):
            continue
        stack = [c for c in top.co_consts if isinstance(c, types.CodeType)]
        while stack:
            nested = [c for c in stack.pop().co_consts if isinstance(c, types.CodeType)]
            codes += nested
            stack += nested
    return codes


_CODE_FIELDS = ("co_code", "co_consts", "co_names", "co_varnames", "co_freevars", "co_cellvars", "co_flags",
                "co_argcount", "co_posonlyargcount", "co_kwonlyargcount", "co_name", "co_firstlineno")


def _same_code(a: types.CodeType, b: types.CodeType) -> bool:
    # Field by field: `==` on code objects also compares the interpreter's specialised bytes,
    # which differ once the function has run (Python 3.11+).
    return all(getattr(a, f, None) == getattr(b, f, None) for f in _CODE_FIELDS)


def _torch_wrapper_of(new: Any, old: Any, codes: list[types.CodeType]) -> bool:
    code = getattr(new, "__code__", None)
    if not isinstance(code, types.CodeType) or not any(_same_code(code, c) for c in codes):
        return False
    try:
        inside = [cell.cell_contents for cell in new.__closure__ or ()]
    except ValueError:  # an empty cell
        return False
    wrapped = [x for x in inside if callable(x)]
    return bool(wrapped) and all(x is old for x in wrapped)


def dispatcher(ops: list[str]) -> dict[str, str]:
    import torch
    out = {}
    for op in sorted(set(HARNESS_OPS) | set(ops)):
        try:
            table = torch._C._dispatch_dump(op)
        except Exception:  # an op name this torch does not have
            continue
        out[f"dispatch {op}"] = hashlib.sha256(table.encode()).hexdigest()[:16]
    out["torch function modes"] = str(torch._C._len_torch_function_stack())
    out["torch dispatch modes"] = str(torch._C._len_torch_dispatch_stack())
    return out


def _optional(owner: Any, getter: str) -> Any:
    """What a getter some torch versions lack says, or that it is absent."""
    fn = getattr(owner, getter, None)
    try:
        return fn() if callable(fn) else "absent"
    except Exception as e:  # a getter that fails says so, the same way every time
        return f"{type(e).__name__}"


def global_state() -> dict[str, str]:
    import torch
    b = torch.backends
    state = {
        "default dtype": torch.get_default_dtype(), "threads": torch.get_num_threads(),
        "grad enabled": torch.is_grad_enabled(), "inference mode": torch.is_inference_mode_enabled(),
        "autocast": torch.is_autocast_enabled(), "matmul precision": torch.get_float32_matmul_precision(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "cudnn": (b.cudnn.enabled, b.cudnn.benchmark, b.cudnn.deterministic, b.cudnn.allow_tf32),
        "cuda matmul tf32": b.cuda.matmul.allow_tf32,
        "cuda fp16 reduced": b.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "cuda bf16 reduced": b.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "sdpa": (b.cuda.flash_sdp_enabled(), b.cuda.mem_efficient_sdp_enabled(), b.cuda.math_sdp_enabled(),
                 _optional(b.cuda, "cudnn_sdp_enabled"), _optional(b.cuda, "is_flash_attention_available")),
        "cuda fp16 accumulation": getattr(b.cuda.matmul, "allow_fp16_accumulation", None),
        "default device": _optional(torch, "get_default_device"), "interop threads": torch.get_num_interop_threads(),
        "mkldnn": (b.mkldnn.enabled, getattr(b.mkldnn, "deterministic", None)),
        # No getter exists for set_flush_denormal; a denormal that survives a multiply says it is off.
        "denormals flushed": bool(torch.tensor([1e-40], dtype=torch.float32, device="cpu").mul(1.0).item() == 0.0),
        "sys profile": repr(sys.getprofile()), "sys trace": repr(sys.gettrace()),
        "threading profile": repr(getattr(threading, "_profile_hook", None)),
        "threading trace": repr(getattr(threading, "_trace_hook", None)),
    }
    return {k: str(v) for k, v in state.items()}


def snapshot(classes: list[type], ops: list[str]) -> Snapshot:
    objects = _objects(classes)
    snap = Snapshot({**{k: _fingerprint(v) for k, v in objects.items()}, **dispatcher(ops), **global_state()})
    snap.originals = objects
    return snap


def changed(before: dict[str, Any], classes: list[type], ops: list[str]) -> list[str]:
    """Names whose function, code, kernel table or state differs from `before`, and attributes
    new on a class (a `Tensor.clone` set on torch.Tensor shadows the C method); sorted, capped.
    New names in modules are fine: importing a submodule (torch._inductor) adds them."""
    now = snapshot(classes, ops)
    diff = [k for k, v in before.items() if now.get(k) != v]
    originals = getattr(before, "originals", {})
    if diff and "torch._dynamo" in sys.modules and originals:
        codes = torch_wrapper_codes()
        diff = [k for k in diff if not (k in originals and k in now.originals
                                        and _torch_wrapper_of(now.originals[k], originals[k], codes))]
    spaces = _spaces(classes)
    for k in now:
        label, _, name = k.rpartition(".")
        if k in before or not isinstance(spaces.get(label), type):
            continue
        # Python caches data on classes itself (copyreg's __slotnames__): new non-callable dunders are its.
        if name.startswith("__") and not callable(spaces[label].__dict__.get(name)):
            continue
        diff.append(k)
    return sorted(set(diff))[:20]
