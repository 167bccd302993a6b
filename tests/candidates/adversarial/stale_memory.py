"""EXPECT: uninitialized|wrong -- frees the real answer, then returns new memory hoping it still holds it.

What that memory holds is the allocator's choice: the poison (uninitialized), or on the H200 an
intermediate's block the original freed (wrong, error 0.81). Rejected either way."""
import torch


def forward(module, x):
    ref = type(module).forward(module, x)
    del ref
    return torch.empty_like(x)
