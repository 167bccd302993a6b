"""Level 3: a pre-norm transformer block (LayerNorm, multi-head attention, GELU MLP, residual
adds), with attention and the MLP as submodules of their own."""
import os

import torch
import torch.nn.functional as F
from torch import nn

FULL = os.environ.get("NS_SIZE", "full" if torch.cuda.is_available() else "small") == "full"
BATCH, SEQ, EMBED, HEADS = (4, 2048, 2048, 16) if FULL else (2, 10, 32, 4)


class SelfAttention(nn.Module):
    def __init__(self, embed: int, heads: int):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(embed, embed) for _ in range(3))
        self.to_out = nn.Linear(embed, embed)

    def forward(self, x):
        b, s, e = x.shape
        q, k, v = (f(x).view(b, s, self.heads, -1).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.to_out(o.transpose(1, 2).reshape(b, s, e))


class FeedForward(nn.Module):
    def __init__(self, embed: int):
        super().__init__()
        self.fc_in = nn.Linear(embed, 4 * embed)
        self.fc_out = nn.Linear(4 * embed, embed)

    def forward(self, x):
        return self.fc_out(F.gelu(self.fc_in(x)))


class Model(nn.Module):
    def __init__(self, embed: int, heads: int):
        super().__init__()
        self.norm_a, self.norm_b = nn.LayerNorm(embed), nn.LayerNorm(embed)
        self.attn = SelfAttention(embed, heads)
        self.ff = FeedForward(embed)

    def forward(self, x):
        x = x + self.attn(self.norm_a(x))
        return x + self.ff(self.norm_b(x))


def get_init_inputs():
    return [EMBED, HEADS]


def get_inputs():
    return [torch.randn(BATCH, SEQ, EMBED)]
