"""Level 2: Linear, sigmoid, then a sum over the features (one value per row)."""
import os

import torch
from torch import nn

FULL = os.environ.get("NS_SIZE", "full" if torch.cuda.is_available() else "small") == "full"
BATCH, IN, OUT = (4096, 2048, 8192) if FULL else (6, 20, 30)


class Model(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)

    def forward(self, x):
        return torch.sigmoid(self.fc(x)).sum(dim=1, keepdim=True)


def get_init_inputs():
    return [IN, OUT]


def get_inputs():
    return [torch.randn(BATCH, IN)]
