"""A chain of pointwise ops with nothing to share between them: eager runs one pass over memory
per op, torch.compile fuses the chain into one (about 3-4x on one CPU thread)."""
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4096))

    def forward(self, x):
        y = x * self.scale
        for _ in range(6):
            y = torch.sin(y) * 1.01 + torch.cos(y) * 0.5
        return y


def get_inputs():
    return [torch.randn(256, 4096, generator=torch.Generator().manual_seed(0))]


def get_init_inputs():
    return []
