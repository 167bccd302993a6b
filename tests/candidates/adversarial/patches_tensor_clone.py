"""EXPECT: suspicious -- replaces Tensor.clone for everyone, so any snapshot taken with it lies."""
import torch

_real = torch.Tensor.clone
_right = {}


def _clone(self, *args, **kwargs):
    return _real(_right.get(self.shape, self), *args, **kwargs)


torch.Tensor.clone = _clone


def forward(module, x):
    _right[x.shape] = type(module).forward(module, x)
    return torch.zeros_like(x)
