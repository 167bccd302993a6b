"""Fresh inputs drawn from frozen ones and a seed: the frozen values rolled, floats jittered.

A function of (frozen tensor, seed) drawn on the tensor's device with a counter-based generator,
so the reference worker and a candidate worker (sandbox/worker_tensors.py) on the same kind of
device build the same tensors bit for bit, and the freeze (tools/capture.py) can try a draw on the
original before any trial.
"""

from __future__ import annotations

import copy
from typing import Any

PERTURB = 0.25
"""Spread of perturbed parameters: exp(N(0, PERTURB)) as a factor, or PERTURB x their spread added."""

JITTER = 2.0 ** -6
"""Relative jitter of fresh float inputs: a new value everywhere, the same distribution."""

JITTER_PERIOD = 65521
"""Jitter factors drawn per draw (a prime): one period of them scales the rolled values in place.
A normal draw per element was most of a CPU repetition's cost (0.7 of 1.2 s at 64M elements,
against 0.3 s for the call it fed); the roll already moves every value to a random place."""


def _gen(seed: int, device: Any = "cpu"):
    import torch
    return torch.Generator(device=device).manual_seed(seed & ((1 << 63) - 1))


def _sub_seed(g: Any) -> int:
    import torch
    return int(torch.randint(0, 1 << 62, (1,), generator=g))


def vary(x: Any, seed: int, fixed_ints: bool = False) -> Any:
    """A fresh input shaped, laid out and placed like `x`: the frozen values rolled by a random
    offset (every element moves; the distribution, signs, zeros, infinities and integer ranges
    stay), floats also scaled by factors about 1.6% from 1 (JITTER_PERIOD of them, drawn from the
    seed, repeating along the flattened values). Booleans (masks) are kept. Drawn on x's device
    (a counter-based generator there) in new memory; the same seed on the same kind of device
    gives the same tensor in any process. `fixed_ints`: integer tensors are kept too
    (Problem.fixed_ints)."""
    import torch
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bool or x.numel() < 2 or (fixed_ints and not (x.is_floating_point() or x.is_complex())):
            return torch.empty_like(x).copy_(x)
        g = _gen(seed)
        shift = int(torch.randint(1, x.numel(), (1,), generator=g))
        flat = x.reshape(-1)
        rolled = torch.empty_like(flat)  # flat.roll(shift), in two copies (roll's own pass is slower)
        rolled[shift:].copy_(flat[:-shift])
        rolled[:shift].copy_(flat[-shift:])
        if x.is_floating_point():
            # In place, in float32 for 16-bit dtypes (the product rounded once to x's dtype).
            wide = torch.float32 if x.element_size() < 4 else x.dtype
            period = min(JITTER_PERIOD, rolled.numel())
            factor = torch.randn(period, generator=_gen(_sub_seed(g), x.device), device=x.device, dtype=wide)
            factor.mul_(JITTER).add_(1.0)
            rows, tail = divmod(rolled.numel(), period)
            rolled[:rows * period].view(rows, period).mul_(factor)
            rolled[rows * period:].mul_(factor[:tail])
        if x.is_contiguous():  # already new memory laid out like x: no copy pass
            return rolled.view(x.shape)
        return torch.empty_like(x).copy_(rolled.view(x.shape))
    if isinstance(x, dict):
        return {k: vary(v, seed + 7919 * (i + 1), fixed_ints) for i, (k, v) in enumerate(x.items())}
    if isinstance(x, (list, tuple)):
        return type(x)(vary(v, seed + 104729 * (i + 1), fixed_ints) for i, v in enumerate(x))
    return x


def vary_set(args: list, kwargs: dict, seed: int, fixed_ints: bool = False) -> tuple[list, dict]:
    """(args, kwargs) of a fresh input set drawn from a frozen one already on the device."""
    return vary(list(args), seed, fixed_ints), vary(dict(kwargs), seed ^ 0x5DEECE66D, fixed_ints)


def tensors_map(m) -> dict:
    return dict(list(m.named_parameters(remove_duplicate=False)) + list(m.named_buffers(remove_duplicate=False)))


def perturbed(module: Any, seed: int) -> Any:
    """A copy of `module` whose floating parameters and buffers are moved at random: positive
    tensors (norm scales, variances) multiplied by exp(N(0, 0.25)), others shifted by
    0.25 x their spread (1 for a constant tensor, so an all-zero bias becomes one). A candidate
    that ignores a parameter, or assumes it is one or zero, computes something else here.
    Drawn where the tensor lives, in float32 (float64 for float64 tensors): on a GPU the host
    never touches the weights, and the same seed on the same kind of device gives the same bits."""
    import torch
    copy_ = copy.deepcopy(module)
    g = _gen(seed)
    with torch.no_grad():
        for name, t in sorted(tensors_map(copy_).items()):
            if not t.is_floating_point() or not t.numel():
                continue
            wide = torch.float64 if t.dtype == torch.float64 else torch.float32
            base = t.detach().to(wide)
            noise = torch.randn(base.shape, generator=_gen(_sub_seed(g), t.device), device=t.device, dtype=wide)
            if bool((base > 0).all()):
                new = noise.mul_(PERTURB).exp_().mul_(base)
            else:
                spread = float(base.std()) if base.numel() > 1 else 0.0
                spread = spread or float(base.abs().mean()) or 1.0
                new = noise.mul_(PERTURB * spread).add_(base)
            t.copy_(new)
    return copy_
