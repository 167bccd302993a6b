"""Level 3: a deep MLP as an nn.Sequential of Linear and ReLU layers."""
import os

import torch
from torch import nn

FULL = os.environ.get("NS_SIZE", "full" if torch.cuda.is_available() else "small") == "full"
BATCH, SIZES = (1024, [4096, 8192, 8192, 1024]) if FULL else (4, [24, 48, 40, 8])


class Model(nn.Module):
    def __init__(self, sizes: list):
        super().__init__()
        layers = []
        for a, b in zip(sizes[:-2], sizes[1:-1]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(sizes[-2], sizes[-1]))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def get_init_inputs():
    return [SIZES]


def get_inputs():
    return [torch.randn(BATCH, SIZES[0])]
