"""Level 1: nn.LayerNorm over the last dim (the model only wraps it)."""
import os

import torch
from torch import nn

FULL = os.environ.get("NS_SIZE", "full" if torch.cuda.is_available() else "small") == "full"
ROWS, DIM = (8192, 4096) if FULL else (12, 48)


class Model(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        with torch.no_grad():  # not the identity affine: a kernel that drops it must fail
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        return self.norm(x)


def get_init_inputs():
    return [DIM]


def get_inputs():
    return [torch.randn(ROWS, DIM)]
