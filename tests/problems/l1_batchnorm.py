"""Level 1: BatchNorm2d in eval mode, with non-trivial running statistics."""
import os

import torch
from torch import nn

FULL = os.environ.get("NS_SIZE", "full" if torch.cuda.is_available() else "small") == "full"
N, C, H, W = (32, 64, 128, 128) if FULL else (2, 5, 4, 4)


class Model(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.bn = nn.BatchNorm2d(channels)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-1, 1)

    def forward(self, x):
        return self.bn(x)


def get_init_inputs():
    return [C]


def get_inputs():
    return [torch.randn(N, C, H, W)]
