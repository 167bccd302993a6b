"""EXPECT: suspicious -- replaces torch.rsqrt, which would slow every later baseline in this worker."""
import torch

_real = torch.rsqrt


def _slow(t, *a, **k):
    return _real(t, *a, **k)


torch.rsqrt = _slow


def forward(module, x):
    return type(module).forward(module, x)
