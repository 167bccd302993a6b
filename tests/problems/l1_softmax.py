"""Level 1: softmax over the rows of a matrix."""
import os

import torch
from torch import nn

FULL = os.environ.get("NS_SIZE", "full" if torch.cuda.is_available() else "small") == "full"
ROWS, DIM = (4096, 16384) if FULL else (8, 100)


class Model(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=1)


def get_init_inputs():
    return []


def get_inputs():
    return [3 * torch.randn(ROWS, DIM)]
