"""Level 1: max over the last dim (values only)."""
import os

import torch
from torch import nn

FULL = os.environ.get("NS_SIZE", "full" if torch.cuda.is_available() else "small") == "full"
SHAPE = (128, 1024, 1024) if FULL else (4, 6, 25)


class Model(nn.Module):
    def forward(self, x):
        return torch.amax(x, dim=-1)


def get_init_inputs():
    return []


def get_inputs():
    return [torch.randn(SHAPE)]
