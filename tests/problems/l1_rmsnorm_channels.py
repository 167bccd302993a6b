"""Level 1: RMS normalisation over the channel dim of an NCHW tensor (no weight)."""
import os

import torch
from torch import nn

FULL = os.environ.get("NS_SIZE", "full" if torch.cuda.is_available() else "small") == "full"
SHAPE = (16, 64, 128, 128) if FULL else (2, 8, 6, 6)


class Model(nn.Module):
    def __init__(self, channels: int, eps: float = 1e-5):
        super().__init__()
        self.channels, self.eps = channels, eps

    def forward(self, x):
        return x / torch.sqrt(x.pow(2).mean(dim=1, keepdim=True) + self.eps)


def get_init_inputs():
    return [SHAPE[1]]


def get_inputs():
    return [torch.randn(SHAPE)]
