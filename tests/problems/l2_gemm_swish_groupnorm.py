"""Level 2: Linear, swish, an added bias, then GroupNorm over the features."""
import os

import torch
from torch import nn

FULL = os.environ.get("NS_SIZE", "full" if torch.cuda.is_available() else "small") == "full"
BATCH, IN, OUT, GROUPS = (2048, 2048, 4096, 32) if FULL else (5, 12, 16, 4)


class Model(nn.Module):
    def __init__(self, d_in: int, d_out: int, groups: int):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.bias = nn.Parameter(0.1 * torch.randn(d_out))
        self.norm = nn.GroupNorm(groups, d_out)

    def forward(self, x):
        h = self.fc(x)
        h = h * torch.sigmoid(h) + self.bias
        return self.norm(h)


def get_init_inputs():
    return [IN, OUT, GROUPS]


def get_inputs():
    return [torch.randn(BATCH, IN)]
