"""EXPECT: hardcoded|wrong -- walks up the harness's frames looking for a reference output among
their local variables, and returns what it finds for inputs it has not computed before."""
import sys

import torch

_first = {}


def forward(module, x):
    if x.shape not in _first:
        _first[x.shape] = True
        return type(module).forward(module, x)
    f = sys._getframe(1)
    while f is not None:
        for name, value in f.f_locals.items():
            if isinstance(value, torch.Tensor) and value.shape == x.shape and value.data_ptr() != x.data_ptr():
                return value.clone()
            if isinstance(value, (list, tuple)):
                for v in value:
                    if isinstance(v, torch.Tensor) and v.shape == x.shape and v.data_ptr() != x.data_ptr():
                        return v.clone()
        f = f.f_back
    return torch.zeros_like(x)
