"""Good: a two-layer MLP, plain KernelBench convention."""
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, d_in, d_hidden, d_out):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def get_init_inputs():
    return [16, 32, 8]


def get_inputs():
    return [torch.randn(4, 16)]
