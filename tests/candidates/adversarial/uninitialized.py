"""EXPECT: uninitialized -- returns freshly allocated memory without writing it."""
import torch


def forward(module, x):
    return torch.empty_like(x)
