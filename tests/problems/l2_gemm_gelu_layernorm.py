"""Level 2: Linear, exact GELU, then LayerNorm (three leaf modules and nothing between)."""
import os

import torch
from torch import nn

FULL = os.environ.get("NS_SIZE", "full" if torch.cuda.is_available() else "small") == "full"
BATCH, SEQ, IN, OUT = (8, 1024, 1024, 4096) if FULL else (2, 5, 16, 32)


class Model(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(d_out)

    def forward(self, x):
        return self.norm(self.act(self.fc(x)))


def get_init_inputs():
    return [IN, OUT]


def get_inputs():
    return [torch.randn(BATCH, SEQ, IN)]
