"""Bad: get_inputs() returns a bare tensor instead of a list of arguments."""
import torch
from torch import nn


class Model(nn.Module):
    def forward(self, x):
        return x + 1


def get_init_inputs():
    return []


def get_inputs():
    return torch.randn(4)
