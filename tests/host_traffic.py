"""What a call would do on a GPU that a CUDA graph cannot capture, seen on the CPU.

A capture fails on a host-to-device copy ("Cannot copy between CPU and CUDA tensors during CUDA
graph capture") and on anything that waits for the device (`.item()`, `bool(t)`, `.cpu()`). On
a CPU every tensor is a host tensor, so `HostTraffic` follows where each one came from instead:
the model's parameters, buffers and the call's inputs are on the device, and so is whatever is
computed from them or made with a `device=` argument; a tensor made without one (`torch.arange(n)`,
`torch.tensor(0.5)`) is on the host. It records, with the line of code that did it:

- a copy to the device: `torch.tensor(data, device=...)`, `as_tensor`, and a host tensor moved
  (`.to(device)`, `.cuda()`, `copy_` into a device tensor);
- a host tensor of more than one element meeting a device tensor in one op (an error there);
- a wait for the device: `.item()`, `.tolist()`, `bool()`, `int()`, `float()`, `.cpu()`,
  `.numpy()`, `nonzero`, on a device tensor.

While active, `torch.cuda.is_current_stream_capturing()` answers True, so code that takes
another path under a capture (transformers skips its data-dependent mask checks then, and passes
a mask it otherwise leaves out) takes that path here too. Calls from Triton's interpreter (the
CPU stand-in for a kernel launch) are not the model's and are not counted.
"""

from __future__ import annotations

import traceback
import weakref
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.empty, torch.full, torch.rand, torch.randn, torch.randint,
             torch.linspace, torch.logspace, torch.eye, torch.empty_strided, torch.scalar_tensor}
FROM_HOST = {torch.tensor, torch.as_tensor, torch.from_numpy}
SYNCS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero", "argwhere"}
MOVES = {"to", "cuda", "copy_"}
OURS = ("/triton/", "host_traffic.py", "/torch/")


def _site() -> str:
    """The innermost line of the model's (or a candidate's) own code on the stack."""
    for f in reversed(traceback.extract_stack()[:-3]):
        if not any(part in f.filename for part in OURS):
            return f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}: {(f.line or '').strip()}"
    return "?"


def _from_triton() -> bool:
    return any("/triton/" in f.filename for f in traceback.extract_stack()[:-3])


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


class HostTraffic(TorchFunctionMode):
    """Records what a capture could not take (`found`: one line each, with where it happened)."""

    def __init__(self):
        super().__init__()
        self._host: dict[int, weakref.ref] = {}  # by id: a tensor's == is elementwise
        self.found: list[str] = []

    def _is_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def _mark(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            self._host[id(t)] = weakref.ref(t)

    def _say(self, what: str) -> None:
        line = f"{what} at {_site()}"
        if line not in self.found:
            self.found.append(line)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _from_triton():
            return out
        name = getattr(func, "__name__", "")
        ins = _tensors((args, kwargs))
        host = [t for t in ins if self._is_host(t)]
        if func in FROM_HOST:
            if kwargs.get("device") is not None:
                self._say(f"{name}(...) copies from the host to the device")
            else:
                self._mark(_tensors(out))
        elif func in FACTORIES:
            if kwargs.get("device") is None:
                self._mark(_tensors(out))
        elif name in SYNCS and ins and not self._is_host(ins[0]):
            self._say(f"{name}() waits for the device")
        elif name in MOVES and host and (name != "to" or _moves_to_device(args, kwargs)):
            self._say(f"a host tensor {tuple(host[0].shape)} copied to the device by {name}")
            for t in _tensors(out):  # on the device from here on (on the CPU `.to` may return itself)
                self._host.pop(id(t), None)
        elif host and len(host) < len(ins) and any(t.numel() > 1 for t in host):
            self._say(f"a host tensor {tuple(host[0].shape)} meets a device tensor in {name}")
        elif host and len(host) == len(ins):
            self._mark(_tensors(out))  # computed on the host from host tensors only
        return out


def _moves_to_device(args, kwargs) -> bool:
    """Whether a `.to(...)` call names a device or another tensor (not only a dtype, nor the
    literal "cpu"): on the CPU every device is the CPU, so `.to(x.device)` counts as the device."""
    rest = list(args[1:]) + list(kwargs.values())
    return any(isinstance(a, (torch.device, torch.Tensor)) or (isinstance(a, str) and a != "cpu") for a in rest)


@contextmanager
def capturing():
    """`HostTraffic` over the block, with `torch.cuda.is_current_stream_capturing()` true."""
    probe, before = HostTraffic(), torch.cuda.is_current_stream_capturing
    torch.cuda.is_current_stream_capturing = lambda: True
    try:
        with probe:
            yield probe
    finally:
        torch.cuda.is_current_stream_capturing = before


# -- the routed transformers models, probed in a process of their own ----------------------------
# (TRITON_INTERPRET=1 must be set before triton is imported: tests/test_capture_traffic.py runs
# `python -m tests.host_traffic STEM... ` with it and reads the JSON this prints.)
REGIONS = {
    "hf_llama": ("LlamaAttention", "LlamaMLP", "LlamaRMSNorm"),
    "hf_qwen2": ("Qwen2Attention", "Qwen2MLP", "Qwen2RMSNorm"),
    "hf_qwen3": ("Qwen3Attention", "Qwen3MLP", "Qwen3RMSNorm"),
    "hf_mistral": ("MistralAttention", "MistralMLP", "MistralRMSNorm"),
    "hf_gpt2": ("GPT2Attention", "GPT2MLP", "LayerNorm"),
}


def compiles() -> int:
    """Frames dynamo has been asked to compile in this process so far."""
    import torch._dynamo.utils
    return torch._dynamo.utils.counters["frames"]["total"]


def import_file(path):
    import importlib.util
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def routed(folder, routes: list[tuple[str, str]], name: str):
    """kernels/route_model.py.j2 with (class, winner source) routes, imported here: a test, not the tuner."""
    from agent.prompting import render_code
    path = folder / f"{name}.py"
    path.write_text(render_code("kernels/route_model.py.j2", routes=[{"cls": c, "source": s} for c, s in routes]))
    return import_file(path)


def probe_routed(stem: str, folder) -> dict:
    """The model file tests/problems/<stem>.py with the first template candidate of each of its
    REGIONS routed in: per workload what the probe found under a capture and the largest error
    against the untouched model; the compiles the calls made; the templates routed."""
    import warnings
    from pathlib import Path

    from agent.planners.library import applicable, default_params, render
    from tools.capture import RegionChoice, freeze
    from tools.modelfile import load_model
    path = Path(__file__).resolve().parent / "problems" / f"{stem}.py"
    loaded = load_model(path, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        frozen, skipped = freeze(loaded, [RegionChoice(c) for c in REGIONS[stem]], folder / "problems",
                                 torch.device("cpu"))
    routes, used = [], []
    for p in frozen:
        offered = applicable(p)  # none for an attention fed by a cache yet (issue 48, item 2)
        if offered:
            template, binding = offered[0]
            routes.append((p.region_class, render(template, binding, default_params(template))))
            used.append(template.name)
    forward = routed(folder, routes, f"routed_{stem}").forward
    model, before, out = load_model(path, "cpu").model, compiles(), {}
    for w in loaded.workloads:
        restore = getattr(w, "restore", lambda: None)  # the KV cache as the workload made it
        with torch.no_grad():
            restore()
            want = model(*w.inputs)
            restore()
            with capturing() as probe:
                got = forward(model, *w.inputs)
        out[w.name] = {"found": probe.found, "error": float((got - want).abs().max())}
    return {"skipped": [s.reason for s in skipped], "templates": used, "workloads": out,
            "compiles": compiles() - before}


if __name__ == "__main__":
    import json
    import sys
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps({stem: probe_routed(stem, Path(tmp) / stem) for stem in sys.argv[1:]}))
