"""Level 1: a 3x3 convolution with padding (the model only wraps nn.Conv2d)."""
import os

import torch
from torch import nn

FULL = os.environ.get("NS_SIZE", "full" if torch.cuda.is_available() else "small") == "full"
N, C, H, W, OUT = (16, 64, 128, 128, 128) if FULL else (2, 3, 8, 8, 4)


class Model(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=False)

    def forward(self, x):
        return self.conv(x)


def get_init_inputs():
    return [C, OUT]


def get_inputs():
    return [torch.randn(N, C, H, W)]
