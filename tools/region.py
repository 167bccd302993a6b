"""A region is one module of the model, rebuilt on its own from the model file and its state."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from tools.modelfile import ModelFileError, _call, _as_list, import_model_file


CALL_SEED = 0
"""A region that draws random numbers in its forward (KernelBench's LSTM draws its initial
state with torch.randn) has no fixed answer; such a problem is frozen `seeded_calls`, and every
call of it, the original's and each candidate's, starts from torch.manual_seed(CALL_SEED), as
KernelBench's own harness seeds before each model call. A candidate then matches only by
drawing what the original draws, in the same order."""


def _rng_states(device: torch.device) -> list[torch.Tensor]:
    states = [torch.random.get_rng_state()]
    if device.type == "cuda" and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state(device))
    return states


def draws_random(fn, device: torch.device) -> tuple[Any, bool]:
    """fn()'s result, and whether it advanced torch's global random state (CPU, or `device`'s)."""
    before = _rng_states(device)
    out = fn()
    after = _rng_states(device)
    return out, any(not torch.equal(a, b) for a, b in zip(before, after))


@contextmanager
def seeded_rng(device: torch.device):
    """torch.manual_seed(CALL_SEED) for the block, the caller's random state restored after (the
    tuner's own draws must stay unpredictable)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(CALL_SEED)
        yield


def seeded(fwd):
    """`fwd(module, *args, **kwargs)` called right after torch.manual_seed(CALL_SEED)."""
    def call(module, *args, **kwargs):
        torch.manual_seed(CALL_SEED)
        return fwd(module, *args, **kwargs)
    return call


def module_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, persistent or not, by dotted name, detached on the CPU."""
    state = {n: p.detach().cpu().clone() for n, p in module.named_parameters(remove_duplicate=False)}
    state.update({n: b.detach().cpu().clone() for n, b in module.named_buffers(remove_duplicate=False)})
    return state


def scalar_attributes(module: torch.nn.Module) -> dict[str, float | int | bool | str]:
    """Plain scalar attributes of a module and its direct children (as `child.attr`)."""
    out: dict[str, Any] = {}

    def take(prefix: str, m: torch.nn.Module) -> None:
        for k, v in vars(m).items():
            if not k.startswith("_") and k != "training" and isinstance(v, (bool, int, float, str)):
                out[prefix + k] = v

    take("", module)
    for name, child in module.named_children():
        take(f"{name}.", child)
    return out


def tensor_attributes(module: torch.nn.Module) -> list[str]:
    """Tensors a module (or a submodule) holds as plain attributes, neither parameter nor buffer
    (KernelBench's RNNs keep their hidden state so): not in the frozen state, not rebuilt."""
    return [f"{path}.{k}" if path else k for path, m in module.named_modules()
            for k, v in vars(m).items() if isinstance(v, torch.Tensor)]


def _assign(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    *parents, leaf = name.split(".")
    owner = module.get_submodule(".".join(parents)) if parents else module
    if leaf in owner._parameters:
        owner._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    elif leaf in owner._buffers:
        owner._buffers[leaf] = value
    else:
        raise KeyError(name)


def build_region(model_file: str | Path, region_path: str, state: dict[str, torch.Tensor],
                 device: torch.device, on_meta: bool = True) -> torch.nn.Module:
    """Rebuild the module at `region_path` with exactly the frozen `state`.

    With `on_meta` the model is built on the meta device (cheap at any size), so only the
    region's own tensors are ever materialised; if the model cannot be built on meta, or
    without `on_meta` (a small model: Problem.build_on_meta), it is built on the CPU.
    """
    path = Path(model_file)
    mod = import_model_file(path)
    init_inputs = _as_list(path, "get_init_inputs()", _call(path, "get_init_inputs()", mod.get_init_inputs))
    model = None
    if on_meta:
        try:
            with torch.device("meta"), _AllOnMeta():
                model = mod.Model(*init_inputs)
        except Exception:  # not buildable on meta: on the CPU below
            pass
    if model is None:
        model = _call(path, "Model(*get_init_inputs())", mod.Model, *init_inputs)
    try:
        region = model.get_submodule(region_path) if region_path else model
    except AttributeError:
        raise ModelFileError(f"{path}: the model has no module {region_path!r} any more") from None
    if _on_meta(region) and tensor_attributes(region):  # to_empty would leave those on meta, without data
        return build_region(model_file, region_path, state, device, on_meta=False)
    region = region.to_empty(device=device) if _on_meta(region) else region.to(device)
    own = {n for n, _ in region.named_parameters(remove_duplicate=False)} | {
        n for n, _ in region.named_buffers(remove_duplicate=False)}
    if own != set(state):
        raise ModelFileError(f"{path}: module {region_path!r} no longer has the frozen parameters "
                             f"(missing {sorted(set(state) - own)[:3]}, new {sorted(own - set(state))[:3]})")
    for name, value in state.items():
        _assign(region, name, value.to(device))
    return region.eval().requires_grad_(False)


class _AllOnMeta(torch.overrides.TorchFunctionMode):
    """Explicit devices made meta too while a model is built on meta: `nn.utils.skip_init` and
    code like it name the CPU, and a value drawn there and copied into a meta weight failed the
    meta build, so the whole model was built and initialised on the CPU in every worker (the
    example's full preset: 15 s of each GPU worker's start). Code that needs real values at
    construction still fails here and is built on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("device") is not None:
            kwargs["device"] = "meta"
        if func is torch.Tensor.to and args and getattr(args[0], "is_meta", False):
            # a move of a meta tensor stays on meta; a dtype it names still applies
            rest = [a for a in args[1:] if not isinstance(a, (str, torch.device))]
            args = (args[0], *rest)
        return func(*args, **kwargs)


def _on_meta(m: torch.nn.Module) -> bool:
    return any(t.is_meta for t in list(m.parameters()) + list(m.buffers()))


OBJECT_DEPTH = 4
"""How deep `flatten` looks into plain objects' attributes for tensors (a cache's layers' keys)."""


def flatten(out: Any, _depth: int = 0) -> tuple[list[torch.Tensor | None], str]:
    """Outputs as a flat list plus a structure string (`T`, `(T,T)`, `[T,N]`, `{a:T}`, ...). An
    object that holds tensors in its attributes (transformers' DynamicCache, which a causal LM
    returns by default) is its tensors: `<DynamicCache>{layers:[<DynamicLayer>{keys:T,values:T}]}`;
    any other object is `?Type`, no leaf to compare."""
    if isinstance(out, torch.Tensor):
        return [out], "T"
    if out is None:
        return [None], "N"
    if isinstance(out, (tuple, list)):
        leaves, parts = [], []
        for x in out:
            sub, s = flatten(x, _depth)
            leaves += sub
            parts.append(s)
        brackets = "()" if isinstance(out, tuple) else "[]"
        return leaves, brackets[0] + ",".join(parts) + brackets[1]
    if isinstance(out, dict) and all(isinstance(k, str) for k in out):  # also transformers' ModelOutput
        leaves, parts = [], []
        for k, x in out.items():
            sub, s = flatten(x, _depth)
            leaves += sub
            parts.append(f"{k}:{s}")
        return leaves, "{" + ",".join(parts) + "}"
    if held := _tensor_attributes(out, _depth):
        leaves, parts = [], []
        for k, x in held:
            sub, s = flatten(x, _depth + 1)
            leaves += sub
            parts.append(f"{k}:{s}")
        return leaves, f"<{type(out).__name__}>{{" + ",".join(parts) + "}"
    return [None], f"?{type(out).__name__}"


def _tensor_attributes(obj: Any, depth: int) -> list[tuple[str, Any]]:
    """A plain object's attributes (by name) that hold tensors, looked into `OBJECT_DEPTH` deep;
    none for a module (its weights are not its output), a type or an object without a __dict__."""
    if depth >= OBJECT_DEPTH or isinstance(obj, (torch.nn.Module, type)) or not hasattr(obj, "__dict__"):
        return []
    return [(k, v) for k, v in sorted(vars(obj).items()) if not k.startswith("__") and _holds_tensor(v, depth + 1)]


def _holds_tensor(x: Any, depth: int) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, (tuple, list)):
        return any(_holds_tensor(v, depth) for v in x)
    if isinstance(x, dict):
        return any(_holds_tensor(v, depth) for v in x.values())
    return bool(_tensor_attributes(x, depth))


def call_args(input_set: dict, device: torch.device) -> tuple[list, dict]:
    """Clone one frozen input set onto `device` (fresh tensors every call)."""
    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to(device, copy=True)
        if isinstance(x, (list, tuple)):
            return type(x)(move(v) for v in x)
        if isinstance(x, dict):
            return {k: move(v) for k, v in x.items()}
        return x
    return move(list(input_set["args"])), move(dict(input_set["kwargs"]))
