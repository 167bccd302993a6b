"""Level 1: swish (x * sigmoid(beta * x)) with a fixed beta."""
import os

import torch
from torch import nn

FULL = os.environ.get("NS_SIZE", "full" if torch.cuda.is_available() else "small") == "full"
SHAPE = (64, 262144) if FULL else (4, 300)


class Model(nn.Module):
    def __init__(self, beta: float):
        super().__init__()
        self.beta = beta

    def forward(self, x):
        return x * torch.sigmoid(self.beta * x)


def get_init_inputs():
    return [1.5]


def get_inputs():
    return [torch.randn(SHAPE)]
