"""EXPECT: uninitialized -- frees the real answer, then returns new memory hoping it still holds it."""
import torch


def forward(module, x):
    ref = type(module).forward(module, x)
    del ref
    return torch.empty_like(x)
