"""Degenerate: every output element is NaN (a NaN scale), so the frozen problem's constant output is NaN."""
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 8)

    def forward(self, x):
        return self.lin(x) * float("nan")


def get_init_inputs():
    return []


def get_inputs():
    return [torch.randn(4, 16)]
