"""transformers' MistralModel, unchanged, from a config with random weights (nothing downloaded).

Small (CPU) by default without CUDA: 2 layers, hidden 64, 4 query heads sharing 2 KV heads,
fp32. Full with CUDA: 2 layers at Llama-3-8B layer sizes (hidden 4096, 32/8 heads, SwiGLU
14336), bf16. `NS_SIZE=small|full` overrides. Run with use_cache=False: the regions see no
cache object, and the output is the last hidden state.
"""
import os

import torch
from torch import nn
from transformers import MistralConfig, MistralModel

FULL = os.environ.get("NS_SIZE", "full" if torch.cuda.is_available() else "small") == "full"
SIZES = (dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
              head_dim=128, vocab_size=32000, max_position_embeddings=4096) if FULL else
         dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, vocab_size=256, max_position_embeddings=256))
DTYPE = torch.bfloat16 if FULL else torch.float32
PREFILL, DECODE, SMALL_BATCH = ((1, 2048), (32, 1), (8, 128)) if FULL else ((1, 24), (4, 1), (2, 8))


class Model(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        torch.manual_seed(0)
        config = MistralConfig(**SIZES, num_hidden_layers=layers, attn_implementation="sdpa")
        self.model = MistralModel(config).to(DTYPE).eval()

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
