"""Level 1: rows scaled to unit L2 norm."""
import os

import torch
from torch import nn

FULL = os.environ.get("NS_SIZE", "full" if torch.cuda.is_available() else "small") == "full"
ROWS, DIM = (16384, 16384) if FULL else (7, 64)


class Model(nn.Module):
    def forward(self, x):
        return x / torch.linalg.vector_norm(x, ord=2, dim=1, keepdim=True)


def get_init_inputs():
    return []


def get_inputs():
    return [torch.randn(ROWS, DIM)]
