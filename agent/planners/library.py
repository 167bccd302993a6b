"""The kernel template library: Jinja templates that render whole candidate files.

Each `KernelTemplate` names a `prompts/kernels/*.py.j2` file, the search space of its tuning
parameters, and a binding rule (`agent/planners/bindings.py`) that says from shapes and
attributes alone how the template could apply to a problem. A candidate is
`render(template, binding, params)`; whether it computes the region's function is decided by
the verifier against the frozen reference, never here.

    for template, binding in applicable(problem):
        source = render(template, binding, default_params(template))
"""

from __future__ import annotations

import json
import keyword
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

import jinja2

from agent.planners import bindings as rules
from agent.planners import hf_cache, kv_cache, layer_rules
from agent.planners import traced
from agent.prompting import prompts_dir
from tools.problem import Problem


@dataclass(frozen=True)
class KernelTemplate:
    name: str
    file: str
    """Template path under the `prompts` package, e.g. `kernels/rmsnorm.py.j2`."""
    space: dict[str, tuple]
    """Tuning parameter -> the values to search; the first value of each is the default."""
    rule: Callable[[Problem], list[dict]]
    """Problem -> bindings: the ways this template could apply (empty: it does not)."""
    summary: str
    fixed: dict = field(default_factory=dict)
    """Template variables this entry pins, for entries that share a file."""
    fits: Callable[[dict], bool] = lambda params: True
    """Whether a point of the space is worth compiling (shared memory, registers)."""
    why_not: Callable[[Problem], str | None] = lambda problem: None
    """Why a region of the kind this template is written for gets no binding (the report says it);
    None for a region of another kind, or one it binds."""

    def bindings(self, problem: Problem) -> list[dict]:
        """Each rule's binding on top of how the candidate's forward is declared (the region's
        own signature, its main input, the argument values it was verified on)."""
        if problem.inplace_inputs and self.name not in PHASE and self.name not in CACHE_WRITERS:
            return []  # a region writing a KV cache: only the templates that write it can compute it
        call = traced.call_vars(problem)
        if call is None:
            return []
        return [{**call, **self.fixed, **b} for b in self.rule(problem)]

    def sample(self, rng: random.Random) -> dict:
        """A random point of the space that `fits` (the default if none is found quickly)."""
        for _ in range(100):
            params = {k: rng.choice(v) for k, v in self.space.items()}
            if self.fits(params):
                return params
        return default_params(self)


def default_params(template: KernelTemplate) -> dict:
    return {k: values[0] for k, values in template.space.items()}


WIDEN_CAPS = {"BLOCK_M": 512, "BLOCK_N": 16384, "BLOCK_K": 1024, "BLOCK": 16384, "SPLIT_K": 64,
              "HEADS": 32, "num_warps": 32, "num_stages": 8}
"""Parameters a widened space extends at the top (larger tiles, more warps, deeper pipelines), and
how far: past these Triton refuses to compile or no GPU has the registers."""
MAX_WIDEN = 2


def widen(space: dict[str, tuple], level: int) -> dict[str, tuple]:
    """The space with `level` more values at the top of each parameter in `WIDEN_CAPS`: the next
    power of two (block sizes, warps, split-K), or one more pipeline stage. Defaults stay first."""
    out = dict(space)
    for name, cap in WIDEN_CAPS.items():
        values = list(out.get(name, ()))
        if not values or not all(type(v) is int for v in values):
            continue
        for _ in range(level):
            top = max(values)
            nxt = top + 1 if name == "num_stages" else max(1, top * 2)
            if nxt > cap:
                break
            values.append(nxt)
        out[name] = tuple(values)
    return out


# -- spaces --------------------------------------------------------------------------------
# BLOCK_N 0 means "the whole row in registers, one read of the input".
ROW_SPACE = {"BLOCK_N": (0, 1024, 2048, 4096), "num_warps": (8, 4, 16, 2, 1)}
SOFTMAX_SPACE = {"BLOCK_N": (0, 1024, 4096, 8192), "num_warps": (4, 2, 8, 16, 1)}
MATMUL_SPACE = {
    "BLOCK_M": (128, 64, 32, 16, 256),
    "BLOCK_N": (128, 64, 256, 32),
    "BLOCK_K": (64, 32, 128),
    "GROUP_M": (8, 4, 1, 16),
    "num_warps": (8, 4, 2),
    "num_stages": (3, 4, 2, 5),
    "tf32": (False, True),  # fp32 models only: tf32 tensor cores, if the tolerance allows
}
# Defaults from a sweep on one H200 (bf16, M=32, Llama-3-8B projections, CUDA graphs): the
# skinny kernel reaches cuBLAS's ~3.4 TB/s; the GEMM reaches ~0.85x of cuBLAS at 128x256.
SKINNY_SPACE = {
    "BLOCK_N": (64, 32, 16, 128, 256),
    "BLOCK_K": (128, 64, 256, 512),
    "SPLIT_K": (1, 2, 4, 8, 16),  # >1 costs a second launch (the deterministic reduction)
    "num_warps": (4, 2, 8),
    "num_stages": (4, 3, 2, 5),
    "tf32": (False, True),
}
ROPE_SPACE = {"HEADS": (4, 1, 2, 8, 16), "num_warps": (4, 1, 2, 8), "out_layout": ("bhsd", "bshd")}
SMEM_BYTES = 200 * 1024  # under Hopper's 227 KB per block, for 2-byte inputs


def _matmul_fits(weights: int) -> Callable[[dict], bool]:
    def fits(p: dict) -> bool:
        tile = (p["BLOCK_M"] * p["BLOCK_K"] + weights * p["BLOCK_K"] * p["BLOCK_N"]) * 2
        regs = weights * p["BLOCK_M"] * p["BLOCK_N"] // (32 * p["num_warps"])
        return tile * p["num_stages"] <= SMEM_BYTES and regs <= 256
    return fits


def _skinny_fits(weights: int) -> Callable[[dict], bool]:
    def fits(p: dict) -> bool:
        tile = (64 * p["BLOCK_K"] + weights * p["BLOCK_K"] * p["BLOCK_N"]) * 2
        return tile * p["num_stages"] <= SMEM_BYTES
    return fits


DECODE_SPACE = {"BLOCK_N": (64, 32, 128, 16), "SPLITS": ("auto", 4, 8, 16, 32), "num_warps": (4, 2, 8),
                "num_stages": (2, 1, 3)}
PREFILL_SPACE = {"BLOCK_M": (64, 128, 32, 16), "BLOCK_N": (64, 32, 128), "num_warps": (4, 8, 2),
                 "num_stages": (2, 3, 1, 4)}


def _flash_fits(p: dict) -> bool:
    return (p["BLOCK_M"] + 2 * p["BLOCK_N"]) * 128 * 2 * p["num_stages"] <= SMEM_BYTES


_ALL = [
    KernelTemplate("rmsnorm", "kernels/rmsnorm.py.j2", ROW_SPACE, rules.rmsnorm,
                   "RMSNorm over the last dim, one row per program, fp32 sum of squares."),
    KernelTemplate("layernorm", "kernels/layernorm.py.j2", ROW_SPACE, rules.layernorm,
                   "LayerNorm over the last dim, one row per program, fp32 mean and variance."),
    KernelTemplate("softmax", "kernels/softmax.py.j2", SOFTMAX_SPACE, rules.softmax,
                   "Softmax over the last dim: whole row in registers, or an online two-read loop."),
    KernelTemplate("add_rmsnorm", "kernels/add_rmsnorm.py.j2",
                   {**ROW_SPACE, "fuse_input_norm": (True, False)}, rules.decoder_layer,
                   "Pre-norm decoder layer: residual add fused with the post-attention RMSNorm."),
    KernelTemplate("gated_mlp", "kernels/gated_mlp.py.j2",
                   {"gemm": ("concat", "separate"), "BLOCK": (1024, 256, 512, 2048, 4096),
                    "num_warps": (4, 8, 2, 16)}, rules.gated_mlp,
                   "Gated MLP: cuBLAS gate/up (one GEMM on a cached [2I, H] weight), fused "
                   "act(g)*u in Triton, cuBLAS down."),
    KernelTemplate("mlp_dual_gemm", "kernels/mlp_dual_gemm.py.j2",
                   {**MATMUL_SPACE, "down": ("torch", "triton")}, rules.gated_mlp,
                   "Gated MLP: gate and up in one Triton GEMM with an act(g)*u epilogue.",
                   fits=_matmul_fits(2)),
    KernelTemplate("mlp", "kernels/mlp.py.j2", MATMUL_SPACE, rules.mlp,
                   "Two-layer MLP: the first GEMM in Triton with bias and activation in its epilogue, "
                   "the second on cuBLAS (nn.Linear or Conv1D weights).", fits=_matmul_fits(1)),
    KernelTemplate("linear_act", "kernels/linear_act.py.j2",
                   {**MATMUL_SPACE, "BLOCK_N": (256, 128, 64, 32)}, rules.linear,
                   "Linear with bias and activation fused into a Triton GEMM's epilogue.",
                   fits=_matmul_fits(1)),
    KernelTemplate("skinny_linear", "kernels/skinny_linear.py.j2", SKINNY_SPACE,
                   rules.decode_only(rules.linear),
                   "Decode-shaped Linear (few rows): weight-streaming GEMV, split-K.",
                   fits=_skinny_fits(1)),
    KernelTemplate("skinny_mlp", "kernels/skinny_mlp.py.j2", SKINNY_SPACE,
                   rules.decode_only(rules.gated_mlp),
                   "Decode-shaped gated MLP: gate+up streamed by one skinny kernel, then down.",
                   fits=_skinny_fits(2)),
    KernelTemplate("rope_attention", "kernels/attention.py.j2", {**ROPE_SPACE, "qkv": ("separate",)},
                   rules.attention,
                   "Attention with RoPE on q and k in one Triton pass (K/V still repeated).",
                   fixed={"kv": "repeat"}),
    KernelTemplate("gqa_attention", "kernels/attention.py.j2",
                   {"qkv": ("fused", "separate"), **ROPE_SPACE}, rules.attention,
                   "Attention: fused QKV GEMM, one-pass RoPE, SDPA over shared K/V heads "
                   "(enable_gqa, no repeat_interleave copies).",
                   fixed={"kv": "gqa"}),
]
_ALL += [
    KernelTemplate("decode_attention", "kernels/decode_attention.py.j2", DECODE_SPACE, kv_cache.kv_cache_attention,
                   "Attention over a KV cache (written in place): split-KV flash-decoding Triton kernel for "
                   "one new token, SDPA over the cache otherwise."),
    KernelTemplate("prefill_attention", "kernels/prefill_attention.py.j2", PREFILL_SPACE,
                   kv_cache.kv_cache_attention,
                   "Attention over a KV cache (written in place): causal flash-attention Triton kernel with "
                   "the cache offset for prompts, SDPA over the cache for one new token.", fits=_flash_fits),
]
# transformers' attention over its own Cache object, with the masks the model passes.
# bound "positions" (keys up to kwargs['cache_position']) is not offered: transformers 5's caches write
# at their own count, and the verifier's fresh cache_position draws showed it wrong on every model.
CACHE_SPACE = {"path": ("triton", "sdpa"), "qkv": ("fused", "separate"), "bound": ("mask",), **PREFILL_SPACE,
               "SPLITS": DECODE_SPACE["SPLITS"]}
_ALL += [
    KernelTemplate("cache_attention", "kernels/cache_attention.py.j2", CACHE_SPACE, hf_cache.cache_fed_attention,
                   "transformers attention over its Cache (written by cache.update): split-KV decode and "
                   "flash-style Triton kernels reading the call's mask, or SDPA; GQA without copies.",
                   fits=_flash_fits, why_not=hf_cache.refusal_for_cache_fed),
]
# Decode GEMVs with what surrounds them fused in (issue 48): the small-M path up to MAX_M rows,
# cuBLAS (or the children as they are) above it, inside one candidate.
DECODE_GEMV_SPACE = {**SKINNY_SPACE, "SPLIT_K": (4, 1, 2, 8, 16), "MAX_M": (64, 32, 16),
                     "act_at": ("epilogue", "prologue")}
_ALL += [
    KernelTemplate("decode_mlp", "kernels/decode_mlp.py.j2", DECODE_GEMV_SPACE,
                   lambda p: rules.gated_mlp(p) or traced.packed_gated_mlp(p),
                   "Gated MLP, decode-fused: up to MAX_M rows one GEMV streams the cached [gate; up] "
                   "weight with act(g)*u fused, then a split-K down GEMV; cuBLAS above.", fits=_skinny_fits(2)),
    KernelTemplate("decode_layer", "kernels/decode_layer.py.j2", DECODE_GEMV_SPACE, layer_rules.fused_decoder_layer,
                   "Pre-norm decoder layer, decode-fused: attention child as it is; residual add + RMSNorm in "
                   "the gate/up GEMV's prologue, act(g)*u and the second residual in the down GEMV.",
                   fits=_skinny_fits(2)),
    KernelTemplate("decode_ffn", "kernels/decode_ffn.py.j2",
                   {k: v for k, v in DECODE_GEMV_SPACE.items() if k != "act_at"}, rules.mlp,
                   "Two-layer MLP (nn.Linear or Conv1D), decode-fused: up to MAX_M rows two GEMVs, bias and "
                   "activation in the first's epilogue, split-K second; cuBLAS above.", fits=_skinny_fits(1)),
]
TEMPLATES: dict[str, KernelTemplate] = {t.name: t for t in _ALL}
PHASE = {"decode_attention": "decode", "prefill_attention": "prefill"}
"""Templates written for one phase of a workload mix: the heavier phase's goes first."""
CACHE_WRITERS = {"cache_attention", "decode_layer"}
"""Templates that write a transformers Cache object in place (by its own update, or decode_layer by
the attention child it calls as it is)."""


def refusals(problem: Problem) -> list[str]:
    """'template: why' for each template written for this kind of region that refused it."""
    return [f"{t.name}: {why}" for t in TEMPLATES.values() if (why := t.why_not(problem))]


def applicable(problem: Problem) -> list[tuple[KernelTemplate, dict]]:
    """Every (template, binding) that could compute this problem's region; of the templates
    for one phase (decode, prefill), the one for the phase with more of the metric first."""
    found = [(t, b) for t in TEMPLATES.values() for b in t.bindings(problem)]
    if any(t.name in PHASE for t, _ in found):
        decode = kv_cache.decode_share(problem)
        first = "decode" if decode >= 0.5 else "prefill"
        found.sort(key=lambda tb: PHASE.get(tb[0].name, first) != first)
    return found


# -- rendering -----------------------------------------------------------------------------
def _ref(name: str | None) -> str:
    """Python expression for a parameter/buffer/child of `module` by dotted name."""
    if name is None:
        return "None"
    expr = "module"
    for part in name.split("."):
        ok = part.isidentifier() and not keyword.iskeyword(part)
        expr = f"{expr}.{part}" if ok else f"getattr({expr}, {part!r})"
    return expr


def _py(value) -> str:
    """A Python literal; an undefined variable fails here too (repr() would not)."""
    if isinstance(value, jinja2.Undefined):
        value._fail_with_undefined_error()
    return repr(value)


def _load(name: str) -> str:
    return (prompts_dir() / name).read_text()


@cache
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FunctionLoader(_load), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                             autoescape=False)
    env.filters["ref"] = _ref
    env.filters["py"] = _py
    return env


def render(template: KernelTemplate, binding: dict, params: dict) -> str:
    """The candidate source for one binding and one point of the template's space."""
    unknown = set(params) - set(template.space)
    if unknown:
        raise ValueError(f"{template.name}: unknown parameters {sorted(unknown)}")
    clash = set(params) & set(binding)
    if clash:
        raise ValueError(f"{template.name}: {sorted(clash)} given as binding and parameter")
    meta = "binding=" + json.dumps(binding, sort_keys=True) + " params=" + json.dumps(params, sort_keys=True)
    return _environment().get_template(template.file).render(
        **binding, **params, template_name=template.name, meta=meta)
