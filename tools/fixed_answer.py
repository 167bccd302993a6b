"""Whether a region (or the whole model) has one answer to judge candidates by, tried on the
original at freeze time the way verification will try every candidate: on fresh input draws, and
with its parameters moved. A region that fails here would refuse every candidate, its own forward
included, so it is skipped with the reason instead of costing a night of trials.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from tools.draws import perturbed, tensors_map, vary_set
from tools.region import call_args, seeded_rng

MOVED_SEED = 0x5EED
"""The seed of the freeze's own fresh draw and parameter move (verification draws its own)."""

FIXED_INTS_NOTE = ("fresh inputs keep its integer inputs as frozen (floats still move): rolled, its own forward "
                   "raised on them (offsets or lengths that must stay ordered)")


def rewrites_reason(subject: str, names: list[str]) -> str:
    """Why a region (`subject`: "its forward") or the model ("the model") has no fixed answer
    when `rewrites_when_moved` found `names`."""
    return (f"{subject} rewrites its own parameters or buffers once they differ from the frozen ones "
            f"({', '.join(names[:3])}): verification moves them, and would refuse every candidate, the "
            "original's own forward included (an Embedding with max_norm renormalizes the rows it looks up, "
            "for one)")


def fresh_draws(forward: Callable, input_set: dict, device: torch.device, seeded: bool) -> tuple[bool, str | None]:
    """(fixed_ints, why not): whether the sandbox's fresh input draws (tools/draws.py)
    must keep the integer inputs as frozen for `forward` to run on them, and why it cannot run
    even then (None: it can). Rolled, EmbeddingBag's offsets start elsewhere than 0, and every
    trial, the original's own forward included, was lost."""
    why = None
    for fixed in (False, True):
        try:
            args, kwargs = vary_set(*call_args(input_set, device), MOVED_SEED, fixed)
            with torch.no_grad(), (seeded_rng(device) if seeded else contextlib.nullcontext()):
                forward(*args, **kwargs)
            return fixed, None
        except Exception as e:
            why = f"{type(e).__name__}: {str(e)[:200]}"
    return False, why


def rewrites_when_moved(module: torch.nn.Module, call: Callable[[torch.nn.Module, list, dict], Any],
                        input_set: dict, device: torch.device, seeded: bool, fixed_ints: bool) -> list[str]:
    """The parameters and buffers `call` rewrites when they are moved as verification moves them
    (tools/draws.perturbed), on the frozen input set and a fresh draw of it. Verification refuses
    a candidate that leaves them changed: an Embedding with max_norm renormalizes the rows it
    looks up in place, and every trial on such a model read `mutated_input`. Empty where none
    is, or where the check itself cannot run (a copy that does not fit: verification decides)."""
    try:
        moved = perturbed(module, MOVED_SEED)
        before = {n: t._version for n, t in tensors_map(moved).items() if not t.is_inference()}
        args, kwargs = call_args(input_set, device)
        fresh = vary_set(args, kwargs, MOVED_SEED + 1, fixed_ints)
        with torch.no_grad(), (seeded_rng(device) if seeded else contextlib.nullcontext()):
            call(moved, args, kwargs)
            call(moved, *fresh)
        now = tensors_map(moved)
        written = [n for n, v in before.items() if now[n]._version != v]
        if not written:
            return []
        again = tensors_map(perturbed(module, MOVED_SEED))  # an in-place write of the same bits moves nothing
        return [n for n in written if not torch.equal(now[n], again[n])]
    except Exception:
        return []
