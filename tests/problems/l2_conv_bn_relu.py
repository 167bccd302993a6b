"""Level 2: Conv2d, BatchNorm2d (eval), ReLU."""
import os

import torch
from torch import nn

FULL = os.environ.get("NS_SIZE", "full" if torch.cuda.is_available() else "small") == "full"
N, C, H, W, OUT = (32, 64, 64, 64, 128) if FULL else (2, 3, 6, 6, 4)


class Model(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.bn = nn.BatchNorm2d(c_out)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 1.5)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


def get_init_inputs():
    return [C, OUT]


def get_inputs():
    return [torch.randn(N, C, H, W)]
