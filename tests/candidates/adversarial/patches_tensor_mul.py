"""EXPECT: suspicious -- replaces Tensor.__mul__ with a slower one (the baseline multiplies)."""
import time

import torch

_real = torch.Tensor.__mul__


def _slow_mul(a, b):
    time.sleep(0.0001)
    return _real(a, b)


torch.Tensor.__mul__ = _slow_mul


def forward(module, x):
    return type(module).forward(module, x)
