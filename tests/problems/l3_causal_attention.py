"""Level 3: GPT-style causal self-attention: one fused QKV projection, SDPA, output projection."""
import os

import torch
import torch.nn.functional as F
from torch import nn

FULL = os.environ.get("NS_SIZE", "full" if torch.cuda.is_available() else "small") == "full"
BATCH, SEQ, EMBED, HEADS = (8, 1024, 1024, 16) if FULL else (2, 8, 32, 4)


class Model(nn.Module):
    def __init__(self, embed: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(embed, 3 * embed)
        self.proj = nn.Linear(embed, embed)

    def forward(self, x):
        b, s, e = x.shape
        q, k, v = self.qkv(x).split(e, dim=2)
        q, k, v = (t.view(b, s, self.heads, e // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, e))


def get_init_inputs():
    return [EMBED, HEADS]


def get_inputs():
    return [torch.randn(BATCH, SEQ, EMBED)]
