"""Level 3: grouped-query attention with rotary embeddings from precomputed tables, written
out by hand (explicit softmax, no SDPA), with prefill and decode-like workloads."""
import math
import os

import torch
from torch import nn

FULL = os.environ.get("NS_SIZE", "full" if torch.cuda.is_available() else "small") == "full"
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MAX_POS = (2048, 16, 4, 128, 4096) if FULL else (32, 4, 2, 8, 64)
PREFILL, DECODE = ((1, 2048), (16, 1)) if FULL else ((2, 12), (3, 1))


def rotate(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Model(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, max_pos: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.wq = nn.Linear(hidden, heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(heads * head_dim, hidden, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).double() / head_dim))
        angles = torch.outer(torch.arange(max_pos).double(), inv).repeat(1, 2)
        self.register_buffer("table_a", angles.cos().float(), persistent=False)
        self.register_buffer("table_b", angles.sin().float(), persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        c, sn = self.table_a[:s], self.table_b[:s]
        q, k = q * c + rotate(q) * sn, k * c + rotate(k) * sn
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        o = torch.softmax(scores, dim=-1) @ v
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


def get_init_inputs():
    return [HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MAX_POS]


def get_inputs():
    return [torch.randn(*PREFILL, HIDDEN)]


def get_workloads():
    return {"prefill": {"inputs": get_inputs(), "weight": 1.0},
            "decode": {"inputs": [torch.randn(*DECODE, HIDDEN)], "weight": 1.0}}
