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

Workloads (batch x sequence of hidden states): full preset prefill 1x2048, decode 32x1,
small_batch 8x128; small preset prefill 1x256, decode 8x1, small_batch 4x32. Weights and
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
                 head_dim=128, max_positions=4096),
    # Same 3.5x SwiGLU ratio and 4:1 GQA grouping as the full model, at CPU-friendly sizes.
    "small": dict(hidden_size=256, intermediate_size=896, num_heads=8, num_kv_heads=2,
                  head_dim=32, max_positions=512),
}

# (name, batch, sequence) per preset; the first one is what get_inputs() returns.
WORKLOADS = {
    "full": [("prefill", 1, 2048), ("decode", 32, 1), ("small_batch", 8, 128)],
    "small": [("prefill", 1, 256), ("decode", 8, 1), ("small_batch", 4, 32)],
}

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.q_proj(x).view(bsz, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)

        # No KV cache: every call sees positions 0..seq-1.
        cos, sin = self.cos_cached[:seq], self.sin_cached[:seq]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin

        # Query head h reads KV head h // group, as HF's repeat_kv.
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)

        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x))
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

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.norm(hidden_states)


def get_init_inputs() -> list:
    return [llama_config().num_layers]


def get_workloads() -> dict:
    cfg = llama_config()
    workloads = {}
    for i, (name, batch, seq) in enumerate(WORKLOADS[preset_name()]):
        gen = torch.Generator().manual_seed(INPUT_SEED + i)
        # Drawn in float32 and cast, so every dtype sees the same values (up to rounding).
        x = torch.randn(batch, seq, cfg.hidden_size, generator=gen).to(cfg.dtype)
        workloads[name] = {"inputs": [x], "weight": 1.0}
    return workloads


def get_inputs() -> list:
    return next(iter(get_workloads().values()))["inputs"]
