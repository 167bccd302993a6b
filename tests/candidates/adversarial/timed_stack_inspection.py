"""EXPECT: wrong|suspicious -- inspects the call stack and, when called from the harness's timing loop,
returns an uninitialized tensor instead of computing.
TIMING: on"""
import sys

import torch


def _timed() -> bool:
    f = sys._getframe(1)
    while f is not None:
        if "batch" in f.f_code.co_name or "timing" in f.f_code.co_filename:
            return True
        f = f.f_back
    return False


def forward(module, x):
    if _timed():
        return torch.zeros_like(x)
    return type(module).forward(module, x)
