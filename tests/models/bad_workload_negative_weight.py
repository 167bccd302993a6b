"""Bad: a workload with a negative weight."""
import torch
from torch import nn


class Model(nn.Module):
    def forward(self, x):
        return x + 1


def get_init_inputs():
    return []


def get_inputs():
    return [torch.randn(4)]


def get_workloads():
    return {"a": {"inputs": [torch.randn(4)], "weight": 1.0},
            "b": {"inputs": [torch.randn(8)], "weight": -0.5}}
