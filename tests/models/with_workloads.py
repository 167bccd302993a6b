"""Good: a two-input model with named, weighted workloads."""
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, scale):
        return self.proj(x) * scale


def get_init_inputs():
    return [8]


def get_inputs():
    return get_workloads()["short"]["inputs"]


def get_workloads():
    return {
        "short": {"inputs": [torch.randn(2, 4, 8), 2.0], "weight": 3},
        "long": {"inputs": [torch.randn(1, 64, 8), 0.5], "weight": 1.0},
        "unweighted": {"inputs": [torch.randn(1, 1, 8), 1.0]},
    }
