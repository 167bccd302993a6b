"""A Llama-3-style decoder stack (no embedding, no LM head), as a KernelBench-style model file.

Sizes follow Llama-3-8B: hidden 4096, SwiGLU intermediate 14336, 32 query heads sharing
8 KV heads (GQA), head_dim 128, RoPE theta 500000, RMSNorm eps 1e-5. The code is written the
way an eager model usually is (RoPE via `torch.cat`, K/V expanded with `repeat_interleave`,
RMSNorm as separate pointwise ops) so that the tuner has real hotspots to find.

Environment variables, read when the model and its inputs are built (not at import):

- `LLAMA_PRESET=small|full`: `full` (Llama-3-8B sizes) by default when CUDA is available,
  otherwise `small` (hidden 256, 8 heads, 2 KV heads, head_dim 32), which runs every workload
  on a CPU in well under a second.
- `LLAMA_LAYERS=N`: number of decoder layers (default 2).
- `LLAMA_DTYPE=bfloat16|float16|float32|float64`: default bfloat16 with CUDA, float32
  without (Triton's CPU interpreter mishandles bf16).

Workloads are served-model calls over a KV cache: hidden states [batch, new tokens, hidden],
the per-layer caches k_cache, v_cache [layers, batch, kv heads, context + new, head_dim], and
`cache_len`, the number of positions already filled (the history, seeded random values).
Attention writes its new keys and values into the cache in place (`inplace_outputs`: the
verifier compares the updated cache with the original's, see tools/verify.py) and attends
over positions 0 .. cache_len + new - 1, causally.

| workload     | full preset (Llama-3-8B, bf16)   | small preset (CPU)          |
|--------------|----------------------------------|-----------------------------|
| prefill      | 1 x 2048, empty cache            | 1 x 256                     |
| decode       | 32 x 1 over a 4096-position cache | 8 x 1 over 256 positions    |
| long_prefill | 1 x 16384, empty cache           | 1 x 1024                    |
| small_batch  | 8 x 128 after 896 cached tokens  | 4 x 32 after 96             |

Memory (full preset, 2 layers): the decode caches are 2 x 2 x 32 x 8 x 4096 x 128 bf16 =
1.07 GB; long prefill's MLP intermediates 16384 x 14336 bf16 = 0.47 GB each.

`make_workload(batch, new_tokens, context)` builds the inputs of any such shape (what
`--workloads TRACE.jsonl` calls for the shapes of a request trace; the small preset divides
token counts by SMALL_TRACE_SCALE so that a trace's shapes stay CPU-sized). Weights and
inputs are seeded, so every process builds the same model and the same inputs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

WEIGHT_SEED = 0
INPUT_SEED = 1234


@dataclass(frozen=True)
class LlamaConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int = 2
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5
    max_positions: int = 4096
    dtype: torch.dtype = torch.float32


PRESETS = {
    "full": dict(hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8,
                 head_dim=128, max_positions=32768),
    # Same 3.5x SwiGLU ratio and 4:1 GQA grouping as the full model, at CPU-friendly sizes.
    "small": dict(hidden_size=256, intermediate_size=896, num_heads=8, num_kv_heads=2,
                  head_dim=32, max_positions=2048),
}

# (name, batch, new tokens, cached context) per preset; the first is what get_inputs() returns.
WORKLOADS = {
    "full": [("prefill", 1, 2048, 0), ("decode", 32, 1, 4095), ("long_prefill", 1, 16384, 0),
             ("small_batch", 8, 128, 896)],
    "small": [("prefill", 1, 256, 0), ("decode", 8, 1, 255), ("long_prefill", 1, 1024, 0),
              ("small_batch", 4, 32, 96)],
}
SMALL_TRACE_SCALE = 16
"""The small preset's make_workload divides a trace's token counts by this."""

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16,
          "float32": torch.float32, "float64": torch.float64}


def preset_name() -> str:
    default = "full" if torch.cuda.is_available() else "small"
    name = os.environ.get("LLAMA_PRESET", "").strip() or default
    if name not in PRESETS:
        raise ValueError(f"LLAMA_PRESET={name!r} is not one of {', '.join(PRESETS)}")
    return name


def llama_config(num_layers: int | None = None) -> LlamaConfig:
    """The configuration the environment asks for (see the module docstring)."""
    if num_layers is None:
        raw = os.environ.get("LLAMA_LAYERS", "").strip() or "2"
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"LLAMA_LAYERS={raw!r} must be a positive integer")
        num_layers = int(raw)
    dtype_name = os.environ.get("LLAMA_DTYPE", "").strip()
    if dtype_name and dtype_name not in DTYPES:
        raise ValueError(f"LLAMA_DTYPE={dtype_name!r} is not one of {', '.join(DTYPES)}")
    dtype = DTYPES[dtype_name] if dtype_name else (
        torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    return LlamaConfig(**PRESETS[preset_name()], num_layers=num_layers, dtype=dtype)


def _linear(in_features: int, out_features: int, dtype: torch.dtype) -> nn.Linear:
    # skip_init avoids the default Kaiming init, which would double the (seconds-long)
    # construction time of the full model only to be overwritten here.
    layer = nn.utils.skip_init(nn.Linear, in_features, out_features, bias=False, dtype=dtype)
    with torch.no_grad():
        # Drawn in float32 so that the values do not depend on the model dtype.
        layer.weight.copy_(torch.empty(out_features, in_features).normal_(0.0, 0.02))
    return layer


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5, dtype: torch.dtype = torch.float32):
        super().__init__()
        # Near 1 but not exactly: a kernel that reads the wrong norm weight must show up.
        init = 1.0 + 0.05 * torch.randn(hidden_size)
        self.weight = nn.Parameter(init.to(dtype))
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        # HF upcasts to float32; promote_types keeps float64 (used by the reference tests).
        h = x.to(torch.promote_types(input_dtype, torch.float32))
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(input_dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(head_dim: int, max_positions: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [max_positions, head_dim] in the HF layout (frequencies repeated twice).

    Computed in float64: positions up to 4096 times float32 frequencies lose ~1e-4 rad.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.num_heads = int(cfg.num_heads)
        self.num_kv_heads = int(cfg.num_kv_heads)
        self.head_dim = int(cfg.head_dim)
        self.q_proj = _linear(cfg.hidden_size, self.num_heads * self.head_dim, cfg.dtype)
        self.k_proj = _linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, cfg.dtype)
        self.v_proj = _linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, cfg.dtype)
        self.o_proj = _linear(self.num_heads * self.head_dim, cfg.hidden_size, cfg.dtype)
        cos, sin = rope_tables(self.head_dim, cfg.max_positions, cfg.rope_theta)
        # Non-persistent: derived from the config, so not part of the state dict (as in HF).
        self.register_buffer("cos_cached", cos.to(cfg.dtype), persistent=False)
        self.register_buffer("sin_cached", sin.to(cfg.dtype), persistent=False)

    inplace_outputs = ("k_cache", "v_cache")
    """Arguments the forward writes into (the verifier compares them with the original's)."""

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor | None = None,
                v_cache: torch.Tensor | None = None, cache_len: int = 0) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.q_proj(x).view(bsz, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)

        # The new tokens sit at positions cache_len .. cache_len + seq - 1.
        end = cache_len + seq
        cos, sin = self.cos_cached[cache_len:end], self.sin_cached[cache_len:end]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if k_cache is not None:
            k_cache[:, :, cache_len:end] = k
            v_cache[:, :, cache_len:end] = v
            k, v = k_cache[:, :, :end], v_cache[:, :, :end]

        # Query head h reads KV head h // group, as HF's repeat_kv.
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)

        if cache_len == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif seq == 1:  # one new token sees the whole cache
            out = F.scaled_dot_product_attention(q, k, v)
        else:  # query i is position cache_len + i: it sees keys 0 .. cache_len + i
            mask = torch.ones(seq, end, dtype=torch.bool, device=x.device).tril(cache_len)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).reshape(bsz, seq, self.num_heads * self.head_dim)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = _linear(cfg.hidden_size, cfg.intermediate_size, cfg.dtype)
        self.up_proj = _linear(cfg.hidden_size, cfg.intermediate_size, cfg.dtype)
        self.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size, cfg.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.dtype)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.dtype)
        self.mlp = LlamaMLP(cfg)

    inplace_outputs = ("k_cache", "v_cache")

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor | None = None,
                v_cache: torch.Tensor | None = None, cache_len: int = 0) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), k_cache, v_cache, cache_len)
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(nn.Module):
    """`num_layers` decoder layers and a final RMSNorm: hidden states [B, S, H] -> [B, S, H]."""

    def __init__(self, num_layers: int | None = None):
        super().__init__()
        cfg = llama_config(num_layers)
        self.config = cfg
        # A private RNG stream: the same weights in every process, without touching the
        # caller's global seed.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(WEIGHT_SEED)
            self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
            self.norm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.dtype)

    inplace_outputs = ("k_cache", "v_cache")

    def forward(self, hidden_states: torch.Tensor, k_cache: torch.Tensor | None = None,
                v_cache: torch.Tensor | None = None, cache_len: int = 0) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            hidden_states = layer(hidden_states, None if k_cache is None else k_cache[i],
                                  None if v_cache is None else v_cache[i], cache_len)
        return self.norm(hidden_states)


def get_init_inputs() -> list:
    return [llama_config().num_layers]


def cache_inputs(batch: int, new_tokens: int, context: int, seed: int = INPUT_SEED) -> list:
    """[hidden states, k_cache, v_cache, cache_len] for `batch` sequences of `new_tokens` new
    tokens after `context` cached ones (seeded: the same values in every process)."""
    cfg = llama_config()
    if batch < 1 or new_tokens < 1 or context < 0:
        raise ValueError(f"batch {batch}, new tokens {new_tokens}, context {context}: need batch >= 1, "
                         "new tokens >= 1, context >= 0")
    if context + new_tokens > cfg.max_positions:
        raise ValueError(f"context {context} + new tokens {new_tokens} is past this preset's "
                         f"{cfg.max_positions} positions")
    gen = torch.Generator().manual_seed(seed)
    # Drawn in float32 and cast, so every dtype sees the same values (up to rounding).
    x = torch.randn(batch, new_tokens, cfg.hidden_size, generator=gen).to(cfg.dtype)
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, context + new_tokens, cfg.head_dim)
    # History at the scale k_proj/v_proj give (std 0.02 * sqrt(hidden)); new positions zero.
    caches = []
    for _ in range(2):
        cache = torch.zeros(shape, dtype=cfg.dtype)
        if context:
            hist = torch.randn(*shape[:3], context, shape[4], generator=gen) * (0.02 * cfg.hidden_size ** 0.5)
            cache[:, :, :, :context] = hist.to(cfg.dtype)
        caches.append(cache)
    return [x, caches[0], caches[1], context]


def make_workload(batch: int, new_tokens: int, context: int) -> list:
    """The inputs of one shape of a request trace (`--workloads TRACE.jsonl`); the small
    preset scales token counts down by SMALL_TRACE_SCALE."""
    if preset_name() == "small":
        new_tokens = max(1, new_tokens // SMALL_TRACE_SCALE) if new_tokens > 1 else 1
        context //= SMALL_TRACE_SCALE
    return cache_inputs(batch, new_tokens, context, INPUT_SEED + 7919 * batch + 31 * new_tokens + context)


def get_workloads() -> dict:
    return {name: {"inputs": cache_inputs(batch, new, context, INPUT_SEED + i), "weight": 1.0}
            for i, (name, batch, new, context) in enumerate(WORKLOADS[preset_name()])}


def get_inputs() -> list:
    return next(iter(get_workloads().values()))["inputs"]
