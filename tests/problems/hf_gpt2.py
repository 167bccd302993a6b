"""transformers' GPT2Model, unchanged, from a config with random weights (nothing downloaded).

Small (CPU) by default without CUDA: 2 layers, hidden 64, 4 heads, fp32. Full with CUDA:
2 layers of GPT-2 XL width (1600, 25 heads), bf16. `NS_SIZE=small|full` overrides. Run with
use_cache=False; the output is the last hidden state.
"""
import os

import torch
from torch import nn
from transformers import GPT2Config, GPT2Model

FULL = os.environ.get("NS_SIZE", "full" if torch.cuda.is_available() else "small") == "full"
SIZES = (dict(n_embd=1600, n_head=25, vocab_size=50257, n_positions=2048) if FULL else
         dict(n_embd=64, n_head=4, vocab_size=256, n_positions=256))
DTYPE = torch.bfloat16 if FULL else torch.float32
PREFILL, DECODE, SMALL_BATCH = ((1, 1024), (32, 1), (8, 128)) if FULL else ((1, 24), (4, 1), (2, 8))


class Model(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        torch.manual_seed(0)
        config = GPT2Config(**SIZES, n_layer=layers, attn_implementation="sdpa")
        self.model = GPT2Model(config).to(DTYPE).eval()

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).last_hidden_state


def _ids(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, SIZES["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(batch * seq))


def get_init_inputs():
    return [2]


def get_inputs():
    return [_ids(*PREFILL)]


def get_workloads():
    return {"prefill": {"inputs": [_ids(*PREFILL)], "weight": 1.0},
            "decode": {"inputs": [_ids(*DECODE)], "weight": 1.0},
            "small_batch": {"inputs": [_ids(*SMALL_BATCH)], "weight": 1.0}}
