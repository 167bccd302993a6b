"""Level 2: Linear, then a scale, a bias of its own and ReLU."""
import os

import torch
from torch import nn

FULL = os.environ.get("NS_SIZE", "full" if torch.cuda.is_available() else "small") == "full"
BATCH, IN, OUT = (2048, 4096, 4096) if FULL else (8, 32, 24)


class Model(nn.Module):
    def __init__(self, d_in: int, d_out: int, scale: float):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.shift = nn.Parameter(0.1 * torch.randn(d_out))
        self.scale = scale

    def forward(self, x):
        return torch.relu(self.fc(x) * self.scale + self.shift)


def get_init_inputs():
    return [IN, OUT, 0.5]


def get_inputs():
    return [torch.randn(BATCH, IN)]
