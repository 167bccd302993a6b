"""Recording a region's calls faithfully, as plain data the tuner can load with
`torch.load(weights_only=True)`.

A region is replayed exactly as the model called it: positional arguments stay positional,
keyword arguments stay keywords (transformers' layers call `self_attn(hidden_states=...,
position_embeddings=(cos, sin), attention_mask=None, ...)`), tuples stay tuples, None stays
None, and numbers, strings, dtypes and devices are kept as they are.

transformers' cache objects (`StaticCache`, `DynamicCache`) are frozen as markers of their
tensors and rebuilt at the call (tools/objects.py), their state taken before the call (it writes
into them). Anything else is not plain data and is frozen as **absent** (None), with a note: a
module, a function, a config. The freeze then
rebuilds the region alone and runs it on the frozen arguments; when that no longer gives the
captured outputs (a cache that already holds keys, a callback that matters), the region is
skipped and the reason names the argument. Models run with `use_cache=False` pass no cache
at all. Named tuples become plain tuples and dict subclasses plain dicts, the same check
deciding whether that matters.

Arguments the region declares it writes into (`inplace_outputs`, a KV cache) are copied
before the call, so the frozen input is the state the call starts from; the model's own
workload inputs are restored before every recorded forward (`WorkloadInputs.restore`).

Memory: on a device, tensors are copied to the host once. On the CPU a tensor that covers
its whole storage is shared, not copied, unless the model changes it in place after the
call (its version counter moves): that workload is then recorded again with copies.
"""

from __future__ import annotations

from typing import Any

import torch

from tools.footprint import Admission
from tools.objects import frozen_kind, marker

PLAIN = (bool, int, float, complex, str, bytes, torch.dtype, torch.device)


class Recorder:
    """Turns one call's arguments and outputs into plain data, noting what was dropped."""

    def __init__(self, share: bool):
        self.share = share
        self.notes: list[str] = []
        self.shared: list[tuple[torch.Tensor, int]] = []

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if self.share and t.device.type == "cpu" and _owns_storage(t) and not t.is_inference():
            self.shared.append((t, t._version))
            return t
        return t.to("cpu", copy=True)

    def plain(self, x: Any, where: str) -> Any:
        if isinstance(x, torch.Tensor):
            if type(x) is not torch.Tensor and not isinstance(x, torch.nn.Parameter):
                self.notes.append(f"{where}: a {type(x).__name__} (tensor subclass) frozen as a plain tensor")
            return self.tensor(x.as_subclass(torch.Tensor) if type(x) is not torch.Tensor else x)
        if x is None or isinstance(x, PLAIN):
            return x
        if isinstance(x, torch.Size):
            return x
        if isinstance(x, (list, tuple)):
            out = [self.plain(v, f"{where}[{i}]") for i, v in enumerate(x)]
            if type(x) not in (list, tuple):
                self.notes.append(f"{where}: a {type(x).__name__} frozen as a plain {'tuple' if isinstance(x, tuple) else 'list'}")
            return tuple(out) if isinstance(x, tuple) else out
        if isinstance(x, dict) and all(isinstance(k, (str, int)) for k in x):
            if type(x) is not dict:
                self.notes.append(f"{where}: a {type(x).__name__} frozen as a plain dict")
            return {k: self.plain(v, f"{where}[{k!r}]") for k, v in x.items()}
        if frozen_kind(x):  # transformers' cache: its tensors, rebuilt at the call (tools/objects.py)
            return marker(x, self.plain, where)
        self.notes.append(f"{where}: a {type(x).__name__} is not plain data; frozen as absent (None)")
        return None

    def changed(self) -> bool:
        """Whether a shared tensor was written in place after it was recorded."""
        return any(t._version != v for t, v in self.shared)


def not_plain(x: Any, where: str) -> str | None:
    """Where `x` holds something Recorder.plain would freeze as absent, and what (None: nowhere)."""
    if isinstance(x, torch.Tensor) or x is None or isinstance(x, (*PLAIN, torch.Size)) or frozen_kind(x):
        return None
    if isinstance(x, (list, tuple)):
        return next((w for i, v in enumerate(x) if (w := not_plain(v, f"{where}[{i}]"))), None)
    if isinstance(x, dict) and all(isinstance(k, (str, int)) for k in x):
        return next((w for k, v in x.items() if (w := not_plain(v, f"{where}[{k!r}]"))), None)
    return f"{where}: a {type(x).__name__}"


def _owns_storage(t: torch.Tensor) -> bool:
    """True when the tensor is its storage, so sharing it saves no more than the tensor."""
    try:
        return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    except (RuntimeError, NotImplementedError):
        return False


def nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(nbytes(v) for v in x)
    if isinstance(x, dict):
        return sum(nbytes(v) for v in x.values())
    return 0


def _tensor_args(args: tuple, kwargs: dict) -> list[tuple[Any, torch.Tensor]]:
    return [(k, v) for k, v in [*enumerate(args), *kwargs.items()] if isinstance(v, torch.Tensor)]


def record_calls(model: torch.nn.Module, module: torch.nn.Module, workloads: list, names: list[str],
                 admission: Admission) -> tuple[list[dict], list[Any], dict[str, int], list[str]]:
    """Per workload: the region's first call ({"args", "kwargs"}), its outputs, how often it
    runs per forward, and notes on what was not plain data. Raises DoesNotFit (from
    `admission`) before copying a workload that cannot fit; RuntimeError if never called."""
    from tools.modelfile import inplace_names, tensor_version
    declared = set(inplace_names(type(module)))
    inputs, outputs, per_forward, notes = [], [], {}, []
    for w in workloads:
        # Recorded after the call; a region that writes into an argument nobody declared (a
        # KernelBench x.relu_()) would leave its output beside an input it already changed:
        # seen by the tensors' version counters, and recorded again with every input copied first.
        modes = [(share, False) for share in ((True, False) if admission.device.type == "cpu" else (False,))]
        while modes:
            share, copy_all = modes.pop(0)
            rec, seen, calls = Recorder(share), {}, [0]

            def before(_m, args, kwargs, seen=seen, copy_all=copy_all):
                if "pre" not in seen:  # what the first call starts from, where it writes
                    seen["versions"] = {k: tensor_version(v) for k, v in _tensor_args(args, kwargs)}
                    seen["pre"] = {i: a.detach().to("cpu", copy=True) for i, a in enumerate(args)
                                   if isinstance(a, torch.Tensor) and (copy_all or (i < len(names) and names[i] in declared))}
                    seen["pre"].update({k: v.detach().to("cpu", copy=True) for k, v in kwargs.items()
                                        if isinstance(v, torch.Tensor) and (copy_all or k in declared)})
                    # A cache object is written by the call: its state before it, copied.
                    seen["pre"].update({k: Recorder(False).plain(v, f"argument {k}") for k, v in
                                        [*enumerate(args), *kwargs.items()] if frozen_kind(v)})

            def hook(_m, args, kwargs, output, rec=rec, seen=seen, calls=calls):
                calls[0] += 1
                if "call" in seen:
                    return
                admission.admit(nbytes(args) + nbytes(kwargs), nbytes(output))
                sig = names
                pre = seen.get("pre", {})
                seen["mutated"] = [k for k, v in _tensor_args(args, kwargs) if k not in pre
                                   and seen.get("versions", {}).get(k, tensor_version(v)) != tensor_version(v)]
                args_plain = [pre[i] if i in pre else rec.plain(a, f"argument {sig[i] if i < len(sig) else i}")
                              for i, a in enumerate(args)]
                seen["call"] = ({"args": args_plain, "kwargs": {k: pre[k] if k in pre else rec.plain(v, f"argument {k}")
                                                                for k, v in kwargs.items()}},
                                rec.plain(output, "output"))

            # What forward itself is given and returns: the model's own pre-hooks run before
            # `before`, its forward hooks after `hook` (a winner replaces forward; they stay).
            handles = [module.register_forward_pre_hook(before, with_kwargs=True)]
            handles.append(module.register_forward_hook(hook, with_kwargs=True, prepend=True))
            restore = getattr(w, "restore", None)
            try:
                if restore:
                    restore()
                with torch.no_grad():
                    model(*w.inputs)
            finally:
                for handle in handles:
                    handle.remove()
                if restore:
                    restore()
            if "call" not in seen:
                raise RuntimeError(f"it is not called in workload {w.name!r}")
            if seen["mutated"] and not copy_all:
                modes = [(False, True)]
                notes.append(f"writes into its argument {seen['mutated'][0]} in place (undeclared): "
                             "recorded from a copy taken before the call")
            elif not rec.changed():
                modes = []
            if modes:
                admission.inputs -= nbytes(seen["call"][0])  # recorded again, with copies
                admission.outputs -= nbytes(seen["call"][1])
        inputs.append(seen["call"][0])
        outputs.append(seen["call"][1])
        per_forward[w.name] = calls[0]
        notes += [n for n in rec.notes if n not in notes]
    return inputs, outputs, per_forward, notes
