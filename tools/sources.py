"""The source a region's math lives in beyond its own class: the module classes of the
submodules it calls (at any depth) and the module-level functions its code calls, so that a
fused rewrite of a region (a whole `Model` around a user's norm, say) can be written from
problem.json alone instead of guessed. torch's own modules and functions and Python's are left
out: their math is documented, and `children` names them."""

from __future__ import annotations

import inspect
import sys
import types

import torch

MAX_CHARS = 60_000
"""Characters of called source one problem keeps (a large transformers stack would run on)."""
_DOCUMENTED = {"torch", "triton", "numpy", "typing_extensions"} | set(sys.stdlib_module_names)


def _ours(obj: object) -> bool:
    """Code a reader cannot look up: not torch's, not Python's, not a C builtin."""
    module = getattr(obj, "__module__", None) or ""
    return bool(module) and module.split(".")[0] not in _DOCUMENTED


def _source(obj: object) -> str | None:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return None


def _functions_called(code_owner: object) -> list[types.FunctionType]:
    """Module-level functions the functions of `code_owner` (a class or a function) name."""
    owners = [code_owner] if isinstance(code_owner, types.FunctionType) else \
        [v for v in vars(code_owner).values() if isinstance(v, types.FunctionType)]
    out = []
    for fn in owners:
        try:
            names = inspect.getclosurevars(fn)
        except (TypeError, ValueError):
            continue
        out += [v for v in [*names.globals.values(), *names.nonlocals.values()]
                if isinstance(v, types.FunctionType) and _ours(v)]
    return out


def called_sources(region: torch.nn.Module) -> dict[str, str]:
    """{name: source} of the code `region`'s forward reaches beyond its own class: the classes
    of its submodules and the functions its code (and theirs) calls, in the order first met."""
    found: dict[str, str] = {}
    seen: set[object] = {type(region)}
    pending: list[object] = [type(region)]
    pending += [type(m) for m in region.modules() if type(m) not in seen and _ours(type(m))]
    size = 0
    while pending:
        obj = pending.pop(0)
        if obj is not type(region):
            if obj in seen:
                continue
            seen.add(obj)
            text = _source(obj)
            if text is None:
                continue
            name = obj.__qualname__
            if name in found:  # two classes or functions of one name in different files
                name = f"{obj.__module__}.{obj.__qualname__}"
            if size + len(text) > MAX_CHARS:
                found[name] = f"# left out: problem.json keeps {MAX_CHARS} characters of called source at most\n"
                continue
            found[name] = text
            size += len(text)
        pending += [f for f in _functions_called(obj) if f not in seen]
    return found
