"""Bad: a workload whose weight is NaN."""
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
    return {"nan_one": {"inputs": [torch.randn(4)], "weight": float("nan")}}
