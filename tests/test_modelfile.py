"""tools/modelfile.py against small model files, and the Llama example's faithfulness."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from tools.modelfile import ModelFileError, import_model_file, load_model

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "tests" / "models"
LLAMA = ROOT / "examples" / "llama.py"


# --- good files -------------------------------------------------------------------------

@pytest.mark.parametrize("name, out_shape", [
    ("tiny_mlp", (4, 8)),
    ("conv_relu", (2, 8, 16, 16)),
    ("layernorm_gelu", (2, 10, 64)),
])
def test_good_file_loads_and_runs(name, out_shape):
    loaded = load_model(MODELS / f"{name}.py")
    assert [w.name for w in loaded.workloads] == ["default"]
    with torch.no_grad():
        out = loaded.model(*loaded.workloads[0].inputs)
    assert tuple(out.shape) == out_shape
    assert not loaded.model.training, "the loader hands back a model in eval mode"
    assert len(loaded.file_hash) == 64


def test_workloads_keep_names_weights_and_non_tensor_inputs():
    loaded = load_model(MODELS / "with_workloads.py")
    assert [(w.name, w.weight) for w in loaded.workloads] == [
        ("short", 3.0), ("long", 1.0), ("unweighted", 1.0)]
    short = loaded.workloads[0]
    assert short.inputs[1] == 2.0
    assert tuple(loaded.model(*short.inputs).shape) == (2, 4, 8)


def test_selecting_one_workload():
    loaded = load_model(MODELS / "with_workloads.py", workload="long")
    assert [w.name for w in loaded.workloads] == ["long"]
    with pytest.raises(ModelFileError, match=r"no workload named 'nope' \(has: short, long, unweighted\)"):
        load_model(MODELS / "with_workloads.py", workload="nope")


# --- bad files ----------------------------------------------------------------------------

BAD = [
    ("bad_syntax", ["syntax error at line 6"]),
    ("bad_missing_get_inputs", ["missing `get_inputs`"]),
    ("bad_forward_raises", ["Model.forward on workload 'default' raised RuntimeError", "(line 12)"]),
    ("bad_init_raises", ["Model(*get_init_inputs()) raised ValueError", "dim 3 is not supported",
                         "(line 9)"]),
    ("bad_inputs_not_list", ["get_inputs() must return a list, got Tensor"]),
    ("bad_workload_negative_weight", ["workload 'b' has weight -0.5", "non-negative"]),
    ("bad_workload_nan_weight", ["workload 'nan_one' has weight nan", "finite"]),
    ("bad_workloads_not_dicts", ["each workload needs a name and an 'inputs' list"]),
    ("bad_model_not_module", ["`Model` must be a torch.nn.Module subclass"]),
]


@pytest.mark.parametrize("name, expected", BAD, ids=[b[0] for b in BAD])
def test_bad_file_gives_one_line_error_naming_file_and_problem(name, expected):
    path = MODELS / f"{name}.py"
    with pytest.raises(ModelFileError) as info:
        load_model(path)
    message = str(info.value)
    assert message.startswith(str(path.resolve()) + ": ")
    assert "\n" not in message, "the CLI prints the message as one line"
    for part in expected:
        assert part in message


def test_missing_and_non_python_files():
    with pytest.raises(ModelFileError, match="model file not found"):
        load_model(MODELS / "does_not_exist.py")
    with pytest.raises(ModelFileError, match=r"must be a Python \(.py\) file"):
        load_model(MODELS)


# --- the Llama example --------------------------------------------------------------------

@pytest.fixture
def small_llama(monkeypatch):
    monkeypatch.setenv("LLAMA_PRESET", "small")
    monkeypatch.setenv("LLAMA_DTYPE", "float32")
    monkeypatch.delenv("LLAMA_LAYERS", raising=False)
    return import_model_file(LLAMA)


def test_llama_small_preset_loads_with_kv_cache_workloads(small_llama):
    loaded = load_model(LLAMA)
    shapes = {w.name: (tuple(w.inputs[0].shape), tuple(w.inputs[1].shape), w.inputs[3]) for w in loaded.workloads}
    assert shapes == {"prefill": ((1, 256, 256), (2, 1, 2, 256, 32), 0),
                      "decode": ((8, 1, 256), (2, 8, 2, 256, 32), 255),
                      "long_prefill": ((1, 1024, 256), (2, 1, 2, 1024, 32), 0),
                      "small_batch": ((4, 32, 256), (2, 4, 2, 128, 32), 96)}
    assert len(loaded.model.layers) == 2
    # The forward the load ran to check the model was undone: the caches are as they were made.
    decode = next(w for w in loaded.workloads if w.name == "decode")
    assert decode.inputs[1][:, :, :, 255].abs().max() == 0 and torch.equal(decode.inputs[1], decode.pristine[1])
    with torch.no_grad():
        for w in loaded.workloads:
            out = loaded.model(*w.inputs)
            assert out.shape == w.inputs[0].shape and out.dtype == torch.float32
            assert torch.isfinite(out).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the defaults differ with CUDA")
def test_llama_defaults_without_cuda_are_small_and_float32(monkeypatch):
    for var in ("LLAMA_PRESET", "LLAMA_DTYPE", "LLAMA_LAYERS"):
        monkeypatch.delenv(var, raising=False)
    cfg = import_model_file(LLAMA).llama_config()
    assert (cfg.hidden_size, cfg.num_layers, cfg.dtype) == (256, 2, torch.float32)


def test_llama_is_deterministic_across_builds(small_llama):
    a, b = small_llama.Model(), small_llama.Model()
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert torch.equal(small_llama.get_inputs()[0], small_llama.get_inputs()[0])


def test_llama_layers_env_changes_layer_count(small_llama, monkeypatch):
    monkeypatch.setenv("LLAMA_LAYERS", "3")
    assert len(load_model(LLAMA, check_forward=False).model.layers) == 3
    monkeypatch.setenv("LLAMA_LAYERS", "1")
    assert len(load_model(LLAMA, check_forward=False).model.layers) == 1


def test_llama_dtype_env_and_bad_values(small_llama, monkeypatch):
    monkeypatch.setenv("LLAMA_DTYPE", "float64")
    loaded = load_model(LLAMA, workload="decode")
    assert loaded.model.norm.weight.dtype == torch.float64
    assert loaded.workloads[0].inputs[0].dtype == torch.float64
    monkeypatch.setenv("LLAMA_DTYPE", "fp8")
    with pytest.raises(ModelFileError, match="LLAMA_DTYPE='fp8' is not one of"):
        load_model(LLAMA)
    monkeypatch.setenv("LLAMA_DTYPE", "float32")
    monkeypatch.setenv("LLAMA_PRESET", "huge")
    with pytest.raises(ModelFileError, match="LLAMA_PRESET='huge' is not one of"):
        load_model(LLAMA)


def test_llama_names_other_tools_rely_on(small_llama):
    layer = small_llama.Model().layers[0]
    attn = layer.self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (8, 2, 32)
    assert attn.cos_cached.shape == attn.sin_cached.shape == (2048, 32)
    assert "cos_cached" not in layer.state_dict() and "self_attn.cos_cached" not in layer.state_dict()
    assert isinstance(layer.input_layernorm.eps, float)
    assert layer.mlp.gate_proj.weight.shape == (896, 256)
    assert {n for n, _ in attn.named_children()} == {"q_proj", "k_proj", "v_proj", "o_proj"}


def reference_attention(attn, x: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama attention written out: RoPE as complex rotation of (i, i + d/2) pairs, GQA by
    index mapping, explicit causal softmax. Shares no code with the example."""
    bsz, seq, _ = x.shape
    h, kvh, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q = (x @ attn.q_proj.weight.T).view(bsz, seq, h, d)
    k = (x @ attn.k_proj.weight.T).view(bsz, seq, kvh, d)
    v = (x @ attn.v_proj.weight.T).view(bsz, seq, kvh, d)

    half = d // 2
    freqs = torch.tensor([theta ** (-2.0 * i / d) for i in range(half)], dtype=torch.float64)
    rot = torch.polar(torch.ones(seq, half, dtype=torch.float64),
                      torch.arange(seq, dtype=torch.float64)[:, None] * freqs)[None, :, None, :]

    def rope(t):
        z = torch.complex(t[..., :half], t[..., half:]) * rot
        return torch.cat((z.real, z.imag), dim=-1)

    q, k = rope(q), rope(k)
    mask = torch.full((seq, seq), -math.inf, dtype=torch.float64).triu(1)
    out = torch.empty(bsz, seq, h, d, dtype=torch.float64)
    for head in range(h):
        kv = head * kvh // h  # query heads are grouped contiguously per KV head
        scores = q[:, :, head] @ k[:, :, kv].transpose(-1, -2) / math.sqrt(d) + mask
        out[:, :, head] = scores.softmax(-1) @ v[:, :, kv]
    return out.reshape(bsz, seq, h * d) @ attn.o_proj.weight.T


@pytest.mark.parametrize("batch, seq", [(2, 17), (3, 1)])
def test_llama_attention_matches_reference_in_float64(small_llama, batch, seq):
    cfg = dataclasses.replace(small_llama.llama_config(), dtype=torch.float64)
    torch.manual_seed(0)
    attn = small_llama.LlamaAttention(cfg)
    x = torch.randn(batch, seq, cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        got = attn(x)
        want = reference_attention(attn, x, cfg.rope_theta)
    assert got.dtype == torch.float64
    assert (got - want).abs().max().item() < 1e-10


def test_llama_rmsnorm_and_mlp_match_formulas(small_llama):
    cfg = dataclasses.replace(small_llama.llama_config(), dtype=torch.float64)
    torch.manual_seed(0)
    norm = small_llama.LlamaRMSNorm(cfg.hidden_size, cfg.rms_eps, torch.float64)
    mlp = small_llama.LlamaMLP(cfg)
    x = torch.randn(2, 5, cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        rms = (x.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
        torch.testing.assert_close(norm(x), x / rms * norm.weight, rtol=1e-12, atol=1e-12)
        gate, up = x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T
        want = (gate * torch.sigmoid(gate) * up) @ mlp.down_proj.weight.T
        torch.testing.assert_close(mlp(x), want, rtol=1e-12, atol=1e-12)
    assert not torch.equal(norm.weight, torch.ones_like(norm.weight))


def test_library_imports_are_the_files_own_top_level_absolute_imports():
    from tools.modelfile import library_imports
    source = (
        "import torch, numpy as np\n"
        "from transformers import LlamaConfig, LlamaModel\n"
        "from . import sibling\n"
        "from .layers import Block\n"
        "try:\n    from flash_attn import flash_attn_func\nexcept ImportError:\n    import math\n"
        "if True:\n    import os.path\n"
        "def forward():\n    import secret_inside_a_function\n"
        "class Model:\n    import also_not_top_level\n")
    assert library_imports(source) == [("torch", ()), ("numpy", ()), ("transformers", ("LlamaConfig", "LlamaModel")),
                                       ("flash_attn", ("flash_attn_func",)), ("math", ()), ("os.path", ())]
    assert library_imports("def broken(:\n") == []


def _register_parts(tmp_path, monkeypatch, files: dict[str, str], env: dict[str, str]) -> tuple[dict, object]:
    """Freeze `model.py` (with its sibling `files`) under `env`, then start a worker for its Linear
    problem: the registration's parts, and a trial of the region's own forward."""
    from agent.setup.jobs import profile_and_freeze
    from sandbox.runner import TrialRunner
    from tools.trial import Candidate
    folder = tmp_path / "model"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    monkeypatch.syspath_prepend(str(folder))  # the tuner's own import of it; a worker's sees the folder
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    run = profile_and_freeze(folder / "model.py", "cpu", None, tmp_path / "runs", regions=["Linear"]).run
    for k in env:
        monkeypatch.delenv(k)
    runner = TrialRunner("cpu")
    try:
        runner.add_problem(run.problems_dir / "Linear")
        assert runner._ensure_worker() is None  # started, then the problem registered
        parts = {k: v for k, v in runner.phases.items() if k.startswith("start.register.")}
        own = "def forward(module, *args, **kwargs):\n    return type(module).forward(module, *args, **kwargs)\n"
        return parts, runner.run(Candidate(region="Linear", source=own, planner="manual"), do_time=False)
    finally:
        runner.close()


MODEL_OF = ("import torch\n{imports}\n\n\n"
            "class Model(torch.nn.Module):\n"
            "    def __init__(self):\n        super().__init__()\n        self.lin = Linear(8, 8)\n\n"
            "    def forward(self, x):\n        return self.lin(x)\n\n\n"
            "class Linear(torch.nn.Linear):\n"
            "    def forward(self, x):\n        return super().forward(x) * {scale}\n\n\n"
            "def get_init_inputs():\n    return []\n\n\n"
            "def get_inputs():\n    return [torch.randn(4, 8)]\n")


def test_a_worker_loads_the_model_files_libraries_before_its_first_problem(tmp_path, monkeypatch):
    """A worker imports the model file's libraries (without running the file) once it has said
    hello: the seconds transformers takes are spent before the first problem arrives, while the
    model is still being frozen for a worker started ahead. The registration's import is then
    quick."""
    import subprocess
    import sys
    alone = subprocess.run([sys.executable, "-c", "import time, torch; t = time.time(); "
                            "from transformers import LlamaConfig; print(time.time() - t)"],
                           capture_output=True, text=True, check=True)
    parts, trial = _register_parts(tmp_path, monkeypatch, {"model.py": MODEL_OF.format(
        imports="from transformers import LlamaConfig", scale=1.0)}, {})
    assert trial.status.value == "ok", trial.reason
    assert set(parts) == {"start.register.files", "start.register.import", "start.register.build"}
    assert parts["start.register.import"] < 0.5 * float(alone.stdout), (parts, alone.stdout)


def test_the_model_files_own_modules_are_not_imported_before_its_settings_arrive(tmp_path, monkeypatch):
    """A module beside the model file is the user's code and may read a setting at import; the
    worker applies the model's settings when a problem arrives, so it is not imported ahead
    (imported early it kept the default, and the region computed something else than at freeze)."""
    settings = "import os\nSCALE = float(os.environ.get('NS_TEST_SCALE', '1'))\n"
    parts, trial = _register_parts(tmp_path, monkeypatch, {"settings.py": settings, "model.py": MODEL_OF.format(
        imports="from settings import SCALE", scale="SCALE")}, {"NS_TEST_SCALE": "2"})
    assert trial.status.value == "ok", (trial.status, trial.reason)