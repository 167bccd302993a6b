"""Level 1: a batched matrix product, with a second, decode-shaped workload."""
import os

import torch
from torch import nn

FULL = os.environ.get("NS_SIZE", "full" if torch.cuda.is_available() else "small") == "full"
B, M, K, N = (128, 512, 1024, 512) if FULL else (3, 8, 16, 12)


class Model(nn.Module):
    def forward(self, a, b):
        return torch.bmm(a, b)


def get_init_inputs():
    return []


def get_inputs():
    return [torch.randn(B, M, K), torch.randn(B, K, N)]


def get_workloads():
    return {"square": {"inputs": get_inputs(), "weight": 1.0},
            "one_row": {"inputs": [torch.randn(B, 1, K), torch.randn(B, K, N)], "weight": 0.5}}
