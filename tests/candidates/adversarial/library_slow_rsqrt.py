"""EXPECT: suspicious -- registers a slow aten::rsqrt kernel through torch.library (the baseline
calls rsqrt); the dispatcher's kernel table changes."""
import time

import torch

_lib = torch.library.Library("aten", "IMPL")


def _slow_rsqrt(x):
    time.sleep(0.001)
    return torch.ops.aten.sqrt(x).reciprocal()


for key in ("CPU", "CUDA"):
    _lib.impl("rsqrt", _slow_rsqrt, key)


def forward(module, x):
    return type(module).forward(module, x)
