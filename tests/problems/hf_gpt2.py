"""transformers' GPT2Model, unchanged, from a config with random weights (nothing downloaded),
served as transformers serves it: over its own StaticCache.

Small (CPU) by default without CUDA: 2 layers, hidden 64, 4 heads, fp32. Full with CUDA:
2 layers of GPT-2 XL width (1600, 25 heads of 64), 4096 positions, bf16. `NS_SIZE=small|full`
overrides. GPT-2's attention has no grouped heads: the cache holds every head.

Workloads are the example's (examples/llama.py), over a KV cache: token ids [batch, new tokens],
the per-layer caches k_cache, v_cache [layers, batch, kv heads, context + new, head_dim] and
`cache_len`, the positions already filled (seeded history). The forward hands transformers a
StaticCache whose layers are those tensors, with the cache positions and position ids a
generation step passes, so every layer sees the cache, the mask and the position embeddings
exactly as transformers passes them, and writes its new keys and values into the cache in place
(`inplace_outputs`: the freeze restores them between calls).

| workload    | full (bf16)                      | small (CPU)             |
|-------------|----------------------------------|-------------------------|
| prefill     | 1 x 2048, empty cache            | 1 x 24                  |
| decode      | 32 x 1 over a 4096-position cache | 4 x 1 over 32 positions |
| small_batch | 8 x 128 after 896 cached tokens  | 2 x 8 after 16          |
"""
import inspect
import os

import torch
from torch import nn
from transformers import GPT2Config, GPT2Model, StaticCache

FULL = os.environ.get("NS_SIZE", "full" if torch.cuda.is_available() else "small") == "full"
SIZES = (dict(n_embd=1600, n_head=25, vocab_size=50257, n_positions=4096) if FULL else
         dict(n_embd=64, n_head=4, vocab_size=256, n_positions=256))
DTYPE = torch.bfloat16 if FULL else torch.float32
KV_HEADS, HEAD_DIM, LAYERS = SIZES["n_head"], SIZES["n_embd"] // SIZES["n_head"], 2
# (name, batch, new tokens, cached context); the first is what get_inputs() returns.
WORKLOADS = ([("prefill", 1, 2048, 0), ("decode", 32, 1, 4095), ("small_batch", 8, 128, 896)] if FULL else
             [("prefill", 1, 24, 0), ("decode", 4, 1, 31), ("small_batch", 2, 8, 16)])
# transformers 5 names the argument `cache`, earlier ones `past_key_values`.
CACHE_ARG = "cache" if "cache" in inspect.signature(GPT2Model.forward).parameters else "past_key_values"


def static_cache(config, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: int) -> StaticCache:
    """transformers' StaticCache over the given tensors (no copy): each layer's keys and values
    are views of k_cache[i], v_cache[i], its write position `cache_len`."""
    cache = StaticCache(config=config, max_cache_len=k_cache.shape[3])
    for i, layer in enumerate(cache.layers):
        keys, values = k_cache[i], v_cache[i]  # views by index: unbind's may not be written in place
        layer.keys, layer.values, layer.device, layer.dtype = keys, values, keys.device, keys.dtype
        layer.batch_size = layer.max_batch_size = keys.shape[0]
        layer.num_heads, layer.k_head_dim, layer.v_head_dim = keys.shape[1], keys.shape[3], values.shape[3]
        if hasattr(layer, "cumulative_length"):  # where the layer writes next (transformers >= 5)
            layer.cumulative_length = torch.full((), cache_len, dtype=torch.long, device=keys.device)
        if hasattr(layer, "cumulative_length_int"):  # and a sliding-window layer's count of it
            layer.cumulative_length_int = cache_len
        layer.is_initialized = True
    return cache


class Model(nn.Module):
    inplace_outputs = ("k_cache", "v_cache")
    """Arguments the forward writes into (the verifier compares them with the original's)."""

    def __init__(self, layers: int = LAYERS):
        super().__init__()
        torch.manual_seed(0)
        config = GPT2Config(**SIZES, n_layer=layers, attn_implementation="sdpa")
        self.model = GPT2Model(config).to(DTYPE).eval()

    def forward(self, input_ids, k_cache, v_cache, cache_len: int = 0):
        batch, seq = input_ids.shape
        cache = static_cache(self.model.config, k_cache, v_cache, cache_len)
        position = torch.arange(cache_len, cache_len + seq, device=input_ids.device)
        return self.model(input_ids=input_ids, cache_position=position, position_ids=position.expand(batch, seq),
                          use_cache=True, **{CACHE_ARG: cache}).last_hidden_state


def cache_inputs(batch: int, new_tokens: int, context: int, seed: int) -> list:
    """[token ids, k_cache, v_cache, cache_len]: `batch` sequences of `new_tokens` after `context`
    cached positions (seeded history at the scale the projections give; new positions zero)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SIZES["vocab_size"], (batch, new_tokens), generator=gen)
    shape = (LAYERS, batch, KV_HEADS, context + new_tokens, HEAD_DIM)
    caches = []
    for _ in range(2):
        cache = torch.zeros(shape, dtype=DTYPE)
        if context:
            hist = torch.randn(*shape[:3], context, HEAD_DIM, generator=gen) * (0.02 * SIZES["n_embd"] ** 0.5)
            cache[:, :, :, :context] = hist.to(DTYPE)
        caches.append(cache)
    return [ids, caches[0], caches[1], context]


def get_init_inputs():
    return [LAYERS]


def get_workloads():
    return {name: {"inputs": cache_inputs(batch, new, context, 1234 + i), "weight": 1.0}
            for i, (name, batch, new, context) in enumerate(WORKLOADS)}


def get_inputs():
    return next(iter(get_workloads().values()))["inputs"]
