"""Level 2: Conv2d, tanh, a scale, a per-channel bias, then 2x2 max pooling."""
import os

import torch
import torch.nn.functional as F
from torch import nn

FULL = os.environ.get("NS_SIZE", "full" if torch.cuda.is_available() else "small") == "full"
N, C, H, W, OUT = (64, 32, 128, 128, 64) if FULL else (2, 3, 8, 8, 5)


class Model(nn.Module):
    def __init__(self, c_in: int, c_out: int, scale: float):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3)
        self.bias = nn.Parameter(0.1 * torch.randn(c_out, 1, 1))
        self.scale = scale

    def forward(self, x):
        h = torch.tanh(self.conv(x)) * self.scale + self.bias
        return F.max_pool2d(h, 2)


def get_init_inputs():
    return [C, OUT, 2.0]


def get_inputs():
    return [torch.randn(N, C, H, W)]
