"""Kernel templates: each one renders for every binding of a matching problem, and under the
Triton interpreter the right binding reproduces the module while a wrong guess is caught by
the tolerance (which is why the planner may guess from shapes instead of reading source).

The numeric checks run in one subprocess with TRITON_INTERPRET=1 set before triton is
imported (pytest may already have imported it in this process). The interpreter runs on the
CPU in fp32; its bfloat16 loads are unreliable, so nothing here uses bf16.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.planners.library import TEMPLATES, applicable, default_params, render  # noqa: E402
from tools.problem import Problem, TensorSpec, Tolerance, Workload  # noqa: E402

TOL = 1e-4
# Attention over a KV cache takes the cache as in-place arguments: its templates are checked
# on the example's frozen cache attention in tests/test_kv_cache.py (cache_attention, over a
# transformers Cache, in tests/test_hf_templates.py and tests/test_cache_attention.py), not on
# these one-input cases.
CACHE_TEMPLATES = {"decode_attention", "prefill_attention", "cache_attention"}
TRACED_ONLY = {"decode_layer"}  # binds from a freeze's trace only: tests/test_decode_gemv.py
ONE_INPUT = sorted(set(TEMPLATES) - CACHE_TEMPLATES - TRACED_ONLY)
H, I, NH, NKV, HD, MAX_POS = 64, 96, 4, 2, 16, 32


# -- small fp32 versions of the regions the tuner sees -------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, n, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.2 * torch.randn(n))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Softmax(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1)


class LinearGelu(nn.Module):
    def __init__(self, k, n):
        super().__init__()
        self.fc = nn.Linear(k, n)

    def forward(self, x):
        return F.gelu(self.fc(x))


class MLP(nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class FFN(nn.Module):
    """GPT-2's MLP: Conv1D weights ([in, out], x @ W + b) and the tanh GELU."""

    def __init__(self, h, i):
        super().__init__()
        self.fc_w, self.fc_b = nn.Parameter(0.1 * torch.randn(h, i)), nn.Parameter(0.1 * torch.randn(i))
        self.proj_w, self.proj_b = nn.Parameter(0.1 * torch.randn(i, h)), nn.Parameter(0.1 * torch.randn(h))

    def forward(self, x):
        return F.gelu(x @ self.fc_w + self.fc_b, approximate="tanh") @ self.proj_w + self.proj_b


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, h, nh, nkv, hd, max_pos):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        freqs = torch.outer(torch.arange(max_pos).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x):
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.cos_cached[:S], self.sin_cached[:S]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rep = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1))


class DecoderLayer(nn.Module):
    def __init__(self, h=H, i=I, nh=NH, nkv=NKV, hd=HD, max_pos=MAX_POS):
        super().__init__()
        self.input_layernorm = RMSNorm(h, 1e-5)
        self.self_attn = Attention(h, nh, nkv, hd, max_pos)
        self.post_attention_layernorm = RMSNorm(h, 1e-6)
        self.mlp = MLP(h, i)

    def forward(self, x):
        h = x + self.self_attn(self.input_layernorm(x))
        return h + self.mlp(self.post_attention_layernorm(h))


def _layernorm(n=H):
    m = nn.LayerNorm(n)
    with torch.no_grad():
        m.weight.copy_(1 + 0.2 * torch.randn(n))
        m.bias.copy_(0.2 * torch.randn(n))
    return m


# case -> (module factory, input shape); inputs are randn * 1.0
CASES = {
    "rmsnorm": (lambda: RMSNorm(H), (2, 8, H)),
    "layernorm": (_layernorm, (2, 8, H)),
    "softmax": (Softmax, (2, 8, 50)),
    "linear_gelu": (lambda: LinearGelu(H, 48), (2, 5, H)),
    "mlp": (lambda: MLP(H, I), (2, 8, H)),
    "ffn": (lambda: FFN(H, I), (2, 8, H)),
    "attention": (lambda: Attention(H, NH, NKV, HD, MAX_POS), (2, 8, H)),
    "decoder": (DecoderLayer, (2, 8, H)),
}

# template -> (case it is checked on, what its right binding looks like)
RIGHT = {
    "rmsnorm": ("rmsnorm", {"weight": "weight", "eps": 1e-5, "unit_offset": False}),
    "layernorm": ("layernorm", {"weight": "weight", "bias": "bias"}),
    "softmax": ("softmax", {}),
    "add_rmsnorm": ("decoder", {"norm1": "input_layernorm", "mixer1": "self_attn",
                                "norm2": "post_attention_layernorm", "mixer2": "mlp"}),
    "gated_mlp": ("mlp", {"gate_w": "gate_proj.weight", "up_w": "up_proj.weight", "act": "silu"}),
    "mlp_dual_gemm": ("mlp", {"gate_w": "gate_proj.weight", "up_w": "up_proj.weight", "act": "silu"}),
    "skinny_mlp": ("mlp", {"gate_w": "gate_proj.weight", "up_w": "up_proj.weight", "act": "silu"}),
    "decode_mlp": ("mlp", {"gate_w": "gate_proj.weight", "up_w": "up_proj.weight", "act": "silu"}),
    "linear_act": ("linear_gelu", {"bias": "fc.bias", "act": "gelu"}),
    "mlp": ("ffn", {"w1": "fc_w", "b1": "fc_b", "b2": "proj_b", "layout1": "matmul", "layout2": "matmul",
            "act": "gelu_tanh"}),
    "skinny_linear": ("linear_gelu", {"bias": "fc.bias", "act": "gelu"}),
    "decode_ffn": ("ffn", {"w1": "fc_w", "b1": "fc_b", "b2": "proj_b", "layout1": "matmul", "layout2": "matmul",
                   "act": "gelu_tanh"}),
    "rope_attention": ("attention", {"q_w": "q_proj.weight", "k_w": "k_proj.weight",
                                     "cos": "cos_cached", "o_w": "o_proj.weight", "causal": True}),
    "gqa_attention": ("attention", {"q_w": "q_proj.weight", "k_w": "k_proj.weight",
                                    "cos": "cos_cached", "o_w": "o_proj.weight", "causal": True}),
}

# Points outside the default that reach the other code paths on tiny shapes: looped rows,
# several tiles and K steps, split-K with its reduction, one head per program, ...
EXTRA_POINTS = {
    "rmsnorm": [{"BLOCK_N": 16}],
    "layernorm": [{"BLOCK_N": 16}],
    "softmax": [{"BLOCK_N": 16}],
    "add_rmsnorm": [{"BLOCK_N": 16, "fuse_input_norm": False}],
    "gated_mlp": [{"gemm": "separate", "BLOCK": 32}],
    "mlp_dual_gemm": [{"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 1, "down": "triton"}],
    "linear_act": [{"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 4}],
    "mlp": [{"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 1}],
    "skinny_linear": [{"BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 3}, {"SPLIT_K": 1}],
    "skinny_mlp": [{"BLOCK_N": 32, "BLOCK_K": 16, "SPLIT_K": 2}, {"SPLIT_K": 1}],
    "decode_mlp": [{"BLOCK_N": 32, "BLOCK_K": 16, "SPLIT_K": 2, "act_at": "prologue"}, {"MAX_M": 4}],
    "decode_ffn": [{"BLOCK_N": 32, "BLOCK_K": 16, "SPLIT_K": 2}, {"MAX_M": 4}],
    "rope_attention": [{"HEADS": 1, "out_layout": "bshd"}],
    "gqa_attention": [{"HEADS": 2, "qkv": "separate", "out_layout": "bshd"}],
}


def module_attributes(module: nn.Module) -> dict:
    """Scalar attributes of the module and of its direct children (as `child.attr`)."""
    def scalars(m):
        return {k: v for k, v in vars(m).items()
                if not k.startswith("_") and isinstance(v, (bool, int, float, str))}
    attrs = scalars(module)
    for name, child in module.named_children():
        attrs.update({f"{name}.{k}": v for k, v in scalars(child).items()})
    return attrs


def problem_for(module: nn.Module, *workload_inputs: torch.Tensor) -> Problem:
    """A Problem described the way capture would: parameters+buffers, attributes, children,
    and one workload per example input with its output's spec."""
    workloads = []
    for i, x in enumerate(workload_inputs):
        with torch.no_grad():
            y = module(x)
        workloads.append(Workload(name=f"w{i}", inputs=[TensorSpec.of("x", x)],
                                  outputs=[TensorSpec.of("out", y)]))
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    return Problem(
        name=type(module).__name__, region_class=type(module).__qualname__, region_path="m",
        region_source="", model_file="test", model_hash="", device="cpu",
        parameters=[TensorSpec.of(n, t) for n, t in tensors],
        attributes=module_attributes(module),
        children={n: type(c).__name__ for n, c in module.named_children()},
        workloads=workloads, tolerance=Tolerance(value=TOL))


def build_case(name: str):
    torch.manual_seed(0)
    factory, shape = CASES[name]
    module = factory().eval()
    x = torch.randn(*shape)
    return module, x, problem_for(module, x)


def is_right(binding: dict, expected: dict) -> bool:
    return all(binding.get(k) == v for k, v in expected.items())


# -- in-process: applicability and rendering -----------------------------------------------
@pytest.fixture(scope="module")
def problems():
    return {name: build_case(name)[2] for name in CASES}


def test_each_template_applies_to_its_region_with_the_right_binding(problems):
    for name, (case, expected) in RIGHT.items():
        bindings = TEMPLATES[name].bindings(problems[case])
        assert bindings, f"{name} found no binding for {case}"
        assert any(is_right(b, expected) for b in bindings), (name, bindings)


def test_applicability_follows_shapes(problems):
    names = {case: {t.name for t, _ in applicable(p)} for case, p in problems.items()}
    assert {"rmsnorm", "layernorm"} <= names["rmsnorm"] and "softmax" not in names["rmsnorm"]
    assert names["softmax"] == {"softmax"}
    assert names["mlp"] == {"gated_mlp", "mlp_dual_gemm", "skinny_mlp", "decode_mlp"}
    assert names["attention"] == {"rope_attention", "gqa_attention"}
    assert names["decoder"] == {"add_rmsnorm"}
    assert names["linear_gelu"] == {"linear_act", "skinny_linear"}
    assert names["ffn"] == {"mlp", "decode_ffn"}
    # Prefill-shaped workloads (many rows) get no decode-shaped GEMV.
    torch.manual_seed(0)
    mlp = MLP(H, I)
    prefill = problem_for(mlp, torch.randn(4, 32, H), torch.randn(1, 8, H))
    assert {t.name for t, _ in applicable(prefill)} == {"gated_mlp", "mlp_dual_gemm", "decode_mlp"}  # cuBLAS above MAX_M


def test_bindings_take_constants_from_attributes(problems):
    (eps,) = {b["eps"] for b in TEMPLATES["rmsnorm"].bindings(problems["rmsnorm"])}
    assert eps == 1e-5
    first = TEMPLATES["add_rmsnorm"].bindings(problems["decoder"])[0]
    assert (first["norm1"], first["eps1"], first["eps2"]) == ("input_layernorm", 1e-5, 1e-6)
    attn = TEMPLATES["gqa_attention"].bindings(problems["attention"])
    assert {(b["num_heads"], b["num_kv_heads"], b["head_dim"]) for b in attn} == {(NH, NKV, HD)}
    # Names only order the guesses: the likely assignment comes first.
    assert is_right(attn[0], RIGHT["gqa_attention"][1])
    # Without attributes an RMSNorm still binds, with the usual eps values as guesses.
    bare = problems["rmsnorm"].model_copy(update={"attributes": {}})
    assert {b["eps"] for b in TEMPLATES["rmsnorm"].bindings(bare)} == {1e-5, 1e-6}


@pytest.mark.parametrize("name", ONE_INPUT)
def test_every_binding_and_sampled_point_renders_to_python(name, problems):
    template = TEMPLATES[name]
    rng = random.Random(name)
    points = [default_params(template)] + [template.sample(rng) for _ in range(4)]
    for point in points:
        assert set(point) == set(template.space) and template.fits(point), point
    case = RIGHT[name][0]
    for binding in template.bindings(problems[case]):
        for params in points:
            source = render(template, binding, params)
            compile(source, f"<{name}>", "exec")
            assert "def forward(module" in source


def test_render_fails_loudly_on_a_missing_or_unknown_variable(problems):
    template = TEMPLATES["rmsnorm"]
    binding = template.bindings(problems["rmsnorm"])[0]
    params = default_params(template)
    with pytest.raises(Exception, match="BLOCK_N|undefined"):
        render(template, binding, {k: v for k, v in params.items() if k != "BLOCK_N"})
    with pytest.raises(ValueError, match="unknown"):
        render(template, binding, {**params, "BLOCK_Q": 3})
    with pytest.raises(Exception, match="eps|undefined"):
        render(template, {"weight": "weight"}, params)


# -- numerics: one subprocess under the Triton interpreter ----------------------------------
def _load_candidate(source: str, folder: Path, index: int):
    # Triton reads kernel source with inspect, so candidates must live in real files.
    path = folder / f"candidate_{index}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"ns_candidate_{index}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_numerics() -> dict:
    """Every (template, binding) that applies to each case, at the default point; the right
    binding also at the extra points and one sampled point. Returns {template: {rows, mutated}}."""
    results: dict[str, dict] = {name: {"rows": [], "mutated": []} for name in ONE_INPUT}
    counter = 0
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for case in CASES:
            module, x, problem = build_case(case)
            reference = module(x)
            state = {k: v.clone() for k, v in module.state_dict().items()}
            for template, binding in applicable(problem):
                name = template.name
                right = RIGHT[name][0] == case and is_right(binding, RIGHT[name][1])
                default = default_params(template)
                points = [default]
                if right:
                    points += [{**default, **p} for p in EXTRA_POINTS.get(name, [])]
                    points.append(template.sample(random.Random(name)))
                for params in points:
                    counter += 1
                    try:
                        mod = _load_candidate(render(template, binding, params), Path(tmp), counter)
                        mod.forward(module, x)
                        out = mod.forward(module, x)  # second call: the cached-weights path
                        diff = ((out - reference).abs().max().item()
                                if out.shape == reference.shape else float("inf"))
                        error = None
                    except Exception as e:  # a failing guess is a result, not a crash
                        diff = float("inf")
                        error = "".join(traceback.format_exception_only(e)).strip()[-400:]
                    results[name]["rows"].append({"case": case, "right": right, "binding": binding,
                                                  "params": params, "diff": diff, "error": error})
                changed = [k for k, v in module.state_dict().items() if not torch.equal(v, state[k])]
                results[name]["mutated"] += changed
    return results


@pytest.fixture(scope="module")
def numerics():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, __file__, "--numerics"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"interpreter numerics: {time.monotonic() - start:.1f}s")
    return results


@pytest.mark.parametrize("name", ONE_INPUT)
def test_right_binding_matches_module_under_interpreter(name, numerics):
    result = numerics[name]
    right = [r for r in result["rows"] if r["right"]]
    assert right, f"{name}: the right binding was not offered"
    for r in right:
        assert r["error"] is None and r["diff"] < TOL, r
    assert not result["mutated"], f"{name} changed module state: {result['mutated']}"


@pytest.mark.parametrize("name", [n for n in ONE_INPUT if n != "softmax"])
def test_wrong_guesses_are_caught_by_the_tolerance(name, numerics):
    # Wrong guesses: another role assignment or activation, or (rmsnorm, layernorm) the
    # template applied to the other norm's region, which has the same shapes.
    wrong = [r for r in numerics[name]["rows"] if not r["right"]]
    assert wrong, f"{name} offered only the right binding"
    assert any(r["diff"] >= TOL for r in wrong), wrong
    # The tolerance identifies the right binding: the only wrong guesses that pass compute
    # a function within fp32 tolerance of the right one (tanh-approximated vs erf GELU).
    passing = [r["binding"] for r in wrong if r["diff"] < TOL]
    assert all(b.get("act") in ("gelu", "gelu_tanh") for b in passing), passing


# -- on a GPU: Llama-3-8B sizes in bf16, prefill and decode shapes --------------------------
GPU_CASES = {  # case -> (factory, input shape)
    "rmsnorm": (lambda: RMSNorm(4096), (1, 2048, 4096)),
    "layernorm": (lambda: _layernorm(4096), (1, 2048, 4096)),
    "softmax": (Softmax, (32, 2048, 1024)),
    "linear_gelu": (lambda: LinearGelu(4096, 14336), (1, 2048, 4096)),
    "linear_gelu_decode": (lambda: LinearGelu(4096, 14336), (32, 1, 4096)),
    "mlp": (lambda: MLP(4096, 14336), (1, 2048, 4096)),
    "mlp_decode": (lambda: MLP(4096, 14336), (32, 1, 4096)),
    "ffn": (lambda: FFN(1600, 6400), (1, 1024, 1600)),
    "attention": (lambda: Attention(4096, 32, 8, 128, 4096), (1, 2048, 4096)),
    "decoder": (lambda: DecoderLayer(4096, 14336, 32, 8, 128, 4096), (1, 2048, 4096)),
}
GPU_CASE_OF = {"skinny_linear": "linear_gelu_decode", "skinny_mlp": "mlp_decode"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ONE_INPUT)
def test_right_binding_within_bf16_tolerance_on_gpu(name, tmp_path):
    from tools.problem import default_tolerance
    from triton.testing import do_bench

    case, expected = RIGHT[name]
    case = GPU_CASE_OF.get(name, case)
    torch.manual_seed(0)
    factory, shape = GPU_CASES[case]
    with torch.device("cuda"):
        module = factory().to(torch.bfloat16).eval()
        x = torch.randn(*shape, dtype=torch.bfloat16)
    template = TEMPLATES[name]
    with torch.no_grad():
        reference = module(x)
        ref_max = reference.abs().max().item()
        tol = default_tolerance(reference.dtype, ref_max)
        if tol.kind == "abs":
            # A fused kernel cannot reproduce eager's reduction order, so a rounding can flip by
            # one bf16 ulp; the default abs bound (2e-2) is below one ulp for |ref| in [4, 8).
            tol = tol.model_copy(update={"value": max(tol.value, 2.0 ** (math.floor(math.log2(ref_max)) - 7))})
        (binding,) = [b for b in template.bindings(problem_for(module, x)) if is_right(b, expected)]
        eager_ms = do_bench(lambda: module(x))
        rng = random.Random(0)
        points = [default_params(template)] + [template.sample(rng) for _ in range(2)]
        failures = []
        for i, params in enumerate(points):
            mod = _load_candidate(render(template, binding, params), tmp_path, i)
            try:
                out = mod.forward(module, x)
                err = tol.error((out.float() - reference.float()).abs().max().item(),
                                reference.abs().max().item())
                ms = do_bench(lambda: mod.forward(module, x))
            except Exception as e:
                err, ms = float("inf"), float("nan")
                failures.append((params, str(e)[-300:]))
            print(f"\nGPU {name:15s} {case:19s} err {err:.2e} ({tol}) eager {eager_ms:.3f} ms "
                  f"cand {ms:.3f} ms x{eager_ms / ms:.2f} {params}")
            if err > tol.value:
                failures.append((params, f"out of tolerance: {err:.3e} > {tol}"))
    assert not failures, failures


if __name__ == "__main__" and sys.argv[1:] == ["--numerics"]:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    print(json.dumps(run_numerics()))
