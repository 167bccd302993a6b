"""Loading a user's model file: the KernelBench convention, plus optional named workloads.

A model file defines:

- `class Model(nn.Module)`;
- `get_init_inputs()` -> list of positional arguments for `Model(...)`;
- `get_inputs()` -> list of positional arguments for `Model.forward`;
- optionally `get_workloads()` -> {name: {"inputs": [...], "weight": float}} (or a list of
  dicts with a "name" key); the metric is then the weighted latency over them;
- optionally `make_workload(batch, new_tokens, context)` -> inputs of one request shape, which
  `--workloads TRACE.jsonl` calls for the shapes a request trace groups into (tools/traffic.py);
- optionally `Model.inplace_outputs` (and the same on region classes): names of forward
  arguments the call writes into, such as a KV cache. Their workload inputs are kept pristine
  (restored after every forward the tuner runs itself) so that what is frozen is the state
  before the call, and the verifier compares what a candidate writes there with what the
  original writes (tools/verify.py) instead of rejecting it as `mutated_input`.

Any failure becomes a `ModelFileError` that names the file and says what went wrong in one
line, so the CLI can print it without a traceback.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import math
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any


MODULE_PREFIX = "nightshift_model_"


class ModelFileError(Exception):
    """A model file that cannot be used, with a one-line reason naming the file."""


@dataclass
class WorkloadInputs:
    name: str
    inputs: list[Any]
    weight: float = 1.0
    pristine: list[Any] | None = None
    """Host copies of `inputs` before any call, kept where the model declares in-place outputs."""

    def restore(self) -> None:
        """Undo what forwards wrote into the inputs (a KV cache), so the next call starts as the first."""
        if self.pristine is None:
            return
        for now, before in zip(tensors_in(self.inputs), tensors_in(self.pristine)):
            now.copy_(before)


def tensor_version(t: Any) -> int:
    """A tensor's version counter (an in-place write bumps it); -1 for an inference tensor, which keeps none."""
    try:
        return t._version
    except RuntimeError:
        return -1


def _versions(inputs: list[Any]) -> list[int]:
    return [tensor_version(t) for t in tensors_in(inputs)]


def inplace_names(cls: type) -> tuple[str, ...]:
    """The forward arguments a module class declares it writes into (`inplace_outputs`)."""
    names = getattr(cls, "inplace_outputs", ())
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        return ()
    return tuple(names)


@dataclass
class LoadedModel:
    path: Path
    module: ModuleType
    model: torch.nn.Module
    workloads: list[WorkloadInputs]
    file_hash: str
    init_inputs: list[Any] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables the model file read while it was imported and built (settings such
    as LLAMA_PRESET): sandbox workers get exactly these, nothing else of the tuner's environment."""
    train_only: list[str] = field(default_factory=list)
    """Classes of modules that were in training mode and behave otherwise in inference (BatchNorm,
    Dropout): the model is tuned in eval mode, and the frozen outputs are eval-mode outputs."""


SECRET_HINT = ("KEY", "TOKEN", "SECRET", "PASSW", "CREDENTIAL", "AUTH")


class _RecordingEnviron(os._Environ):
    """os.environ that notes which names are read (os.getenv goes through it too)."""

    def __init__(self, base: os._Environ):
        super().__init__(base._data, base.encodekey, base.decodekey, base.encodevalue, base.decodevalue)
        self.read: set[str] = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)


@contextlib.contextmanager
def recording_environment():
    """Within: reads of os.environ are recorded; yields a dict filled, on exit, with the names
    read that are set and look like settings, not secrets."""
    base, found = os.environ, {}
    rec = _RecordingEnviron(base)
    os.environ = rec
    try:
        yield found
    finally:
        os.environ = base
        for k in sorted(rec.read):
            if isinstance(k, str) and k in base and not any(h in k.upper() for h in SECRET_HINT):
                found[k] = base[k]


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def module_name_for(path: Path) -> str:
    """A stable module name per file content, so the sandbox can import the same classes."""
    return MODULE_PREFIX + file_sha256(path)[:16]


def _where(exc: BaseException, path: Path) -> str:
    """`line N` of the deepest frame inside the model file, if any."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == path]
    return f" (line {frames[-1].lineno})" if frames else ""


def check_model_path(path: str | Path) -> Path:
    """The model file's path, resolved, or the reason it cannot be one."""
    path = Path(path).resolve()
    if not path.exists():
        raise ModelFileError(f"{path}: model file not found")
    if not path.is_file() or path.suffix != ".py":
        raise ModelFileError(f"{path}: a model file must be a Python (.py) file")
    return path


def import_model_file(path: str | Path, origin: str | Path | None = None) -> ModuleType:
    """`origin`: where the file at `path` (a copy) came from; its `__file__` says so, so a model
    reading files beside its own (a config, a vocabulary) finds them in a sandbox worker too."""
    import torch  # here, not at the top: the CLI names a bad flag or a missing file without torch
    path = check_model_path(path)
    name = module_name_for(path)
    if name in sys.modules:
        return sys.modules[name]
    # Its folder serves its sibling imports (`from layers import Block`), as when it runs as a script.
    home = str(Path(origin or path).parent)
    if home not in sys.path and os.access(home, os.R_OK | os.X_OK):
        sys.path.append(home)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    if origin is not None:
        module.__file__ = str(origin)
    # Registered before exec so classes pickle and dataclasses resolve their module.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        del sys.modules[name]
        raise ModelFileError(f"{path}: syntax error at line {e.lineno}: {e.msg}") from None
    except Exception as e:
        del sys.modules[name]
        raise ModelFileError(f"{path}: importing it raised {type(e).__name__}: {e}{_where(e, path)}") from None
    for attr in ("Model", "get_init_inputs", "get_inputs"):
        if not hasattr(module, attr):
            del sys.modules[name]
            raise ModelFileError(
                f"{path}: missing `{attr}` (a model file defines Model, get_init_inputs() and "
                "get_inputs(), as in KernelBench)")
    if not (isinstance(module.Model, type) and issubclass(module.Model, torch.nn.Module)):
        del sys.modules[name]
        raise ModelFileError(f"{path}: `Model` must be a torch.nn.Module subclass")
    return module


def _call(path: Path, what: str, fn, *args):
    try:
        return fn(*args)
    except ModelFileError:
        raise
    except Exception as e:
        raise ModelFileError(f"{path}: {what} raised {type(e).__name__}: {e}{_where(e, path)}") from None


def _as_list(path: Path, what: str, value: Any) -> list[Any]:
    if isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, list):
        raise ModelFileError(f"{path}: {what} must return a list, got {type(value).__name__}")
    return value


def _workloads(path: Path, module: ModuleType) -> list[WorkloadInputs]:
    if not hasattr(module, "get_workloads"):
        inputs = _as_list(path, "get_inputs()", _call(path, "get_inputs()", module.get_inputs))
        return [WorkloadInputs("default", inputs, 1.0)]
    raw = _call(path, "get_workloads()", module.get_workloads)
    if raw is not None and not isinstance(raw, (dict, list, tuple)):
        raise ModelFileError(f"{path}: get_workloads() must return a dict or a list, got {type(raw).__name__}")
    # A non-dict item gets no name here and is rejected with the message below.
    items = list(raw.items()) if isinstance(raw, dict) else [
        (w.get("name") if isinstance(w, dict) else None, w) for w in raw or []]
    if not items:
        raise ModelFileError(f"{path}: get_workloads() returned no workloads")
    out = []
    for name, spec in items:
        if not isinstance(spec, dict) or "inputs" not in spec or not name:
            raise ModelFileError(
                f"{path}: each workload needs a name and an 'inputs' list, got {spec!r:.80}")
        weight = spec.get("weight", 1.0)
        if not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
            raise ModelFileError(f"{path}: workload {name!r} has weight {weight!r}; "
                                 "weights must be finite and non-negative")
        out.append(WorkloadInputs(str(name), _as_list(path, f"workload {name!r} inputs", spec["inputs"]),
                                  float(weight)))
    if sum(w.weight for w in out) <= 0:
        raise ModelFileError(f"{path}: workload weights are all zero")
    return out


def tensors_in(obj: Any):
    import torch
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from tensors_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from tensors_in(x)


def to_device(obj: Any, device: torch.device) -> Any:
    import torch
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def host_copy(obj: Any) -> Any:
    """Tensors in a nested list/tuple/dict, detached and copied to the host."""
    import torch
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(x) for x in obj)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    return obj


def trace_workloads(path: Path, module: ModuleType, trace: str | Path, keep_own: bool = False) -> list[WorkloadInputs]:
    """The workloads a request trace groups into (tools/traffic.py), built by the file's
    `make_workload(batch, new_tokens, context)`; their weights say what the trace costs.
    `keep_own`: the file's own workloads too, named `model:NAME`, at weight 0 (timed and shown,
    not part of the trace's cost)."""
    from tools.traffic import TraceError, group, read_trace
    if not callable(getattr(module, "make_workload", None)):
        raise ModelFileError(f"{path}: --workloads needs make_workload(batch, new_tokens, context) in the model "
                             "file, to build the inputs of each shape of the trace")
    try:
        shapes = group(read_trace(trace))
    except TraceError as e:
        raise ModelFileError(f"--workloads {e}") from None
    out = [WorkloadInputs(s.name, _as_list(path, f"make_workload() for {s.name!r}", _call(
        path, f"make_workload({s.batch}, {s.new_tokens}, {s.context}) for trace shape {s.name!r}",
        module.make_workload, s.batch, s.new_tokens, s.context)), s.weight) for s in shapes]
    own = [WorkloadInputs(f"model:{w.name}", w.inputs, 0.0) for w in _workloads(path, module)] if keep_own else []
    return out + own


def load_model(path: str | Path, device: str | torch.device = "cpu", *, workload: str | None = None,
               check_forward: bool = True, trace: str | Path | None = None,
               trace_keep_own: bool = False) -> LoadedModel:
    """Import the file, build the model on `device`, collect its workloads (or the shapes of a
    request trace) and run one forward pass per workload so that a model that raises fails
    here, with a clear message."""
    import torch
    path = Path(path).resolve()
    device = torch.device(device)
    with recording_environment() as env:
        sys.modules.pop(module_name_for(path), None) if path.is_file() else None  # import again, recorded
        module = import_model_file(path)
        init_inputs = _as_list(path, "get_init_inputs()", _call(path, "get_init_inputs()", module.get_init_inputs))
        model = _call(path, "Model(*get_init_inputs())", module.Model, *init_inputs)
        workloads = _workloads(path, module) if trace is None else trace_workloads(path, module, trace, trace_keep_own)
    if not isinstance(model, torch.nn.Module):
        raise ModelFileError(f"{path}: Model(...) did not return a torch.nn.Module")
    # Tuned for inference: modules that behave otherwise in training are said to run as in inference.
    kinds = sorted({type(m).__name__ for m in model.modules()
                    if m.training and isinstance(m, (torch.nn.modules.batchnorm._BatchNorm,
                                                     torch.nn.modules.dropout._DropoutNd))})
    model = _call(path, f"moving the model to {device}", model.to, device).eval()
    if workload is not None:
        names = [w.name for w in workloads]
        workloads = [w for w in workloads if w.name == workload]
        if not workloads:
            raise ModelFileError(f"{path}: no workload named {workload!r} (has: {', '.join(names)})")
    model_devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    for w in workloads:
        for t in tensors_in(w.inputs):
            if t.device.type not in ("cpu", device.type):
                raise ModelFileError(
                    f"{path}: workload {w.name!r} makes inputs on {t.device}, but the run is on "
                    f"{device}; create inputs on the CPU (they are moved for you)")
        if inplace_names(type(model)):
            w.pristine = host_copy(w.inputs)
        w.inputs = to_device(w.inputs, device)
    if model_devices - {device} and any(d.type != device.type for d in model_devices):
        raise ModelFileError(f"{path}: the model keeps tensors on {sorted(map(str, model_devices))} "
                             f"after .to({device}); register them as parameters or buffers")
    if check_forward:
        written = []
        with torch.no_grad():
            for w in workloads:
                before = _versions(w.inputs)
                _call(path, f"Model.forward on workload {w.name!r}", model, *w.inputs)
                if w.pristine is None and _versions(w.inputs) != before:
                    written.append(w.name)
                w.restore()
        if written:
            # The forward writes into its inputs (a KernelBench `x.relu_()`), undeclared: those
            # are spent. Fresh ones from the file, kept as they were and restored after every
            # forward the tuner runs, as a declared KV cache is.
            again = _workloads(path, module) if trace is None else trace_workloads(path, module, trace, trace_keep_own)
            fresh = {f.name: f for f in again}
            for w in workloads:
                if w.name in written and w.name in fresh:
                    w.pristine = host_copy(fresh[w.name].inputs)
                    w.inputs = to_device(fresh[w.name].inputs, device)
    return LoadedModel(path, module, model, workloads, file_sha256(path), init_inputs, env, train_only=kinds)


def library_imports(source: str) -> list[tuple[str, tuple[str, ...]]]:
    """The absolute imports at a model file's top level (inside `if`/`try` too), as (module,
    names imported from it): what a worker can import ahead of the model file without running
    any of the file's own code. Relative imports and a file that does not parse give nothing."""
    import ast
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out: list[tuple[str, tuple[str, ...]]] = []

    def visit(body: list) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                out.extend((a.name, ()) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                out.append((node.module, tuple(a.name for a in node.names if a.name != "*")))
            elif isinstance(node, (ast.If, ast.Try)):
                for part in (node.body, node.orelse, *(h.body for h in getattr(node, "handlers", [])),
                             getattr(node, "finalbody", [])):
                    visit(part)
    visit(tree.body)
    return out


def preload_imports(source: str, folder: str) -> None:
    """Import what `library_imports` names, names included (transformers loads a model class's
    module only when the name is looked up: most of its import time), except the modules of the
    model file's own `folder`: they are the user's code, and may read settings from the
    environment that the worker applies only when a problem arrives. Failures are left for the
    model file's own import to report."""
    for module, names in library_imports(source):
        top = module.split(".")[0]
        if os.path.exists(os.path.join(folder, top + ".py")) or os.path.isdir(os.path.join(folder, top)):
            continue
        try:
            mod = importlib.import_module(module)
            for n in names:
                if not hasattr(mod, n):
                    importlib.import_module(f"{module}.{n}")
        except Exception:
            continue
