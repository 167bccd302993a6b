"""Level 3: a SwiGLU feed-forward (gate, up, down projections) on a token batch."""
import os

import torch
import torch.nn.functional as F
from torch import nn

FULL = os.environ.get("NS_SIZE", "full" if torch.cuda.is_available() else "small") == "full"
TOKENS, HIDDEN, INNER = (4096, 4096, 11008) if FULL else (6, 32, 48)


class Model(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.w_gate = nn.Linear(hidden, inner, bias=False)
        self.w_in = nn.Linear(hidden, inner, bias=False)
        self.w_out = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.w_out(F.silu(self.w_gate(x)) * self.w_in(x))


def get_init_inputs():
    return [HIDDEN, INNER]


def get_inputs():
    return [torch.randn(1, TOKENS, HIDDEN)]


def get_workloads():
    return {"prefill": {"inputs": get_inputs(), "weight": 1.0},
            "decode": {"inputs": [torch.randn(4, 1, HIDDEN)], "weight": 1.0}}
