"""Level 1: the tanh-approximated GELU, elementwise."""
import os

import torch
import torch.nn.functional as F
from torch import nn

FULL = os.environ.get("NS_SIZE", "full" if torch.cuda.is_available() else "small") == "full"
SHAPE = (4096, 8192) if FULL else (16, 33)


class Model(nn.Module):
    def forward(self, x):
        return F.gelu(x, approximate="tanh")


def get_init_inputs():
    return []


def get_inputs():
    return [torch.randn(SHAPE)]
