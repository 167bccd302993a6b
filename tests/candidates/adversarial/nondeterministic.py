"""EXPECT: nondeterministic -- right on the first call of each input, noisy on repeats."""
import torch

_seen = set()


def forward(module, x):
    y = type(module).forward(module, x)
    key = (tuple(x.shape), float(x.flatten()[0]))
    if key in _seen:
        y = y + torch.randn_like(y)
    _seen.add(key)
    return y
