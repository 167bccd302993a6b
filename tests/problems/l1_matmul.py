"""Level 1: a square-ish matrix product of two inputs."""
import os

import torch
from torch import nn

FULL = os.environ.get("NS_SIZE", "full" if torch.cuda.is_available() else "small") == "full"
M, K, N = (4096, 4096, 4096) if FULL else (24, 40, 16)


class Model(nn.Module):
    def forward(self, a, b):
        return torch.matmul(a, b)


def get_init_inputs():
    return []


def get_inputs():
    return [torch.randn(M, K), torch.randn(K, N)]
