"""Level 1: an inclusive prefix sum along the rows."""
import os

import torch
from torch import nn

FULL = os.environ.get("NS_SIZE", "full" if torch.cuda.is_available() else "small") == "full"
SHAPE = (32768, 4096) if FULL else (6, 30)


class Model(nn.Module):
    def forward(self, x):
        return torch.cumsum(x, dim=1)


def get_init_inputs():
    return []


def get_inputs():
    return [torch.rand(SHAPE)]
