"""EXPECT: shape -- returns garbage whose `clone` (set on the tensor object) hands out the right
answer: a snapshot taken with t.clone() would be fooled."""
import torch


def forward(module, x):
    right = type(module).forward(module, x)
    out = torch.zeros_like(x)
    out.clone = lambda *a, **k: right.clone()
    out.cpu = lambda *a, **k: right.cpu()
    return out
