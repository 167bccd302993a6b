"""`agent apply` into a model whose region classes live in code the user does not own:
transformers' LlamaModel (random init from a small config, nothing downloaded). The winners are
routed at run time by `install()`, which patches the classes' forwards in the user's process;
no file in site-packages is ever edited. Checked in a fresh process, as the user runs the model."""

import hashlib
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from agent.apply import apply_run  # noqa: E402
from tests.test_apply import git  # noqa: E402
from tools.capture import instances_of  # noqa: E402
from tools.fingerprint import instance_fingerprint  # noqa: E402
from tools.modelfile import file_sha256, load_model  # noqa: E402
from tools import seal  # noqa: E402
from tools.problem import Problem, Tolerance, Workload  # noqa: E402
from tools.runfolder import RunFolder, RunInfo  # noqa: E402
from tools.trial import Candidate, Status, Trial  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = '''"""transformers' own Llama: a small config, random init (seeded), nothing downloaded."""
import torch
from torch import nn
from transformers import LlamaConfig, LlamaModel

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.llama = LlamaModel(LlamaConfig(**CONFIG))

    def forward(self, input_ids):
        return self.llama(input_ids=input_ids).last_hidden_state


def get_init_inputs():
    return []


def get_inputs():
    return [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))]
'''
# The original computations in plain torch (what an identity candidate is), counting their calls.
RMSNORM = '''import torch

def forward(module, hidden_states):
    module._ns_calls = getattr(module, "_ns_calls", 0) + 1
    dtype = hidden_states.dtype
    h = hidden_states.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    return module.weight * h.to(dtype)
'''
MLP = '''import torch.nn.functional as F

def forward(module, x):
    module._ns_calls = getattr(module, "_ns_calls", 0) + 1
    return module.down_proj(F.silu(module.gate_proj(x)) * module.up_proj(x))
'''
REGIONS = {"LlamaRMSNorm": ("llama.layers.0.input_layernorm", RMSNORM, 1.3),
           "LlamaMLP": ("llama.layers.0.mlp", MLP, 1.1)}


def make_run(tmp_path: Path) -> tuple[Path, Path]:
    """A run over the model, written directly: a problem per region class (what the freeze would
    record) and one kept candidate each in the store."""
    from transformers.models.llama import modeling_llama
    model = tmp_path / "project" / "hf_llama.py"
    model.parent.mkdir(parents=True)
    model.write_text(MODEL)
    run = RunFolder(tmp_path / "runs" / "hf-llama-test")
    run.path.mkdir(parents=True)
    run.write_info(RunInfo(run_id=run.run_id, model_file=str(model), model_hash=file_sha256(model), device="cpu"))
    store = run.store()
    built = load_model(model, "cpu", check_forward=False).model
    for name, (path, source, speedup) in REGIONS.items():
        paths = instances_of(built, name)
        problem = Problem(name=name, region_class=name, region_path=path, instances=paths,
                          fingerprints={q: instance_fingerprint(built.get_submodule(q)) for q in paths},
                          region_source=inspect.getsource(getattr(modeling_llama, name)), model_file=str(model),
                          model_hash=file_sha256(model), device="cpu", workloads=[Workload(name="default")],
                          tolerance=Tolerance(kind="abs", value=1e-4))
        (run.problems_dir / name).mkdir(parents=True)
        (run.problems_dir / name / "problem.json").write_text(problem.model_dump_json())
        seal.record(run.path, [run.problems_dir / name / "problem.json"])  # as the freeze seals what it froze
        c = Candidate(region=name, source=source)
        store.record(Trial(region=name, candidate_hash=c.hash, candidate_path=str(run.save_candidate(source, c.hash)),
                           status=Status.ok, speedup=speedup, error=0.0, tolerance="abs 0.0001", device="cpu",
                           generation="cpu"))
    store.close()
    return run.path, model


CHECK = textwrap.dedent('''
    import json, sys, warnings
    import torch
    from tools.modelfile import load_model
    original, patched = sys.argv[1], sys.argv[2]
    ref = load_model(original, "cpu", check_forward=False)  # before anything is routed
    with torch.no_grad():
        want = [ref.model(*w.inputs) for w in ref.workloads]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new = load_model(patched, "cpu", check_forward=False)
        with torch.no_grad():
            got = [new.model(*w.inputs) for w in ref.workloads]
    from transformers.models.llama import modeling_llama as ml
    layers = new.model.llama.layers
    print(json.dumps({
        "routed": {n: getattr(getattr(ml, n).forward, "__nightshift_region__", None) for n in ("LlamaRMSNorm", "LlamaMLP",
                                                                                           "LlamaAttention")},
        "norm_calls": [getattr(m, "_ns_calls", 0) for m in new.model.modules() if type(m).__name__ == "LlamaRMSNorm"],
        "mlp_calls": [getattr(layer.mlp, "_ns_calls", 0) for layer in layers],
        "max_diff": max(float((a - b).abs().max()) for a, b in zip(want, got)),
        "warnings": [str(w.message) for w in caught if "nightshift" in str(w.message)],
    }))
''')


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_apply_routes_transformers_classes_at_run_time_in_a_fresh_process(tmp_path):
    from transformers.models.llama import modeling_llama
    site_file = Path(modeling_llama.__file__)
    before = _digest(site_file)
    run, model = make_run(tmp_path)
    original = tmp_path / "original.py"
    original.write_text(MODEL)

    res = apply_run(run)
    assert not res.skipped and not res.warnings, (res.skipped, res.warnings)
    assert {r["region"]: r["class_module"] for r in res.regions} == {
        "LlamaMLP": "transformers.models.llama.modeling_llama", "LlamaRMSNorm": "transformers.models.llama.modeling_llama"}
    kernels = Path(res.kernels_module)
    assert kernels.parent == model.parent  # next to the user's model, never in site-packages
    assert "MODULES = {'LlamaMLP': 'transformers.models.llama.modeling_llama'" in kernels.read_text()
    assert git(model.parent, "apply", res.patch_path).returncode == 0

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-c", CHECK, str(original), str(model)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["routed"] == {"LlamaRMSNorm": "LlamaRMSNorm", "LlamaMLP": "LlamaMLP", "LlamaAttention": None}
    assert out["norm_calls"] == [1] * 5  # two per layer and the final norm, one forward pass
    assert out["mlp_calls"] == [1, 1]
    assert out["max_diff"] <= 1e-5 and out["warnings"] == []
    assert _digest(site_file) == before  # transformers' own file was never touched

    # The same on/off switch as for classes of the model file.
    off = subprocess.run([sys.executable, "-c", CHECK, str(original), str(model)], cwd=tmp_path,
                         env={**env, "NIGHTSHIFT_DISABLE": "1"}, capture_output=True, text=True, timeout=300)
    assert off.returncode == 0, off.stderr[-3000:]
    off_out = json.loads(off.stdout.strip().splitlines()[-1])
    assert set(off_out["routed"].values()) == {None} and off_out["norm_calls"] == [0] * 5
