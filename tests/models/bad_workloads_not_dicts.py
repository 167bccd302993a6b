"""Bad: get_workloads() returns a list of input lists instead of workload dicts."""
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
    return [[torch.randn(4)], [torch.randn(8)]]
