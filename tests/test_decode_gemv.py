"""The decode-fused templates (issue 48, item 3): `decode_mlp` (gate/up in one GEMV on the cached
[gate; up] weight, act(g) * u fused, split-K down) and `decode_layer` (the attention child called as
it is, the residual add and RMSNorm in the gate/up GEMV's prologue, the second residual in the down
GEMV's epilogue), verified by the sandbox in fp32 under Triton's interpreter on transformers' own
models served over their StaticCache (tests/problems/hf_*.py), on every workload: prefill (24 rows),
decode (4 rows), small batch (16 rows). Each candidate takes the fused GEMV path up to MAX_M rows
and the large-M path above, so MAX_M 8 puts decode on the GEMVs and the others on cuBLAS, MAX_M 64
puts all three on the GEMVs; the two ways of placing act(g) * u alternate across the models.
Gemma and Phi-3, none of the five, defend the class: Gemma's GELU-tanh gate and (1 + w) norms,
Phi-3's packed gate_up_proj, bound from the trace.
GPT-2's plain MLP (Conv1D weights) gets `decode_ffn`, the same GEMVs without a gate.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from agent.apply import apply_run
from agent.apply.patch import patched_lines
from agent.planners.library import applicable, default_params, render
from sandbox.runner import TrialRunner
from tools.capture import RegionChoice, freeze
from tools.modelfile import file_sha256, load_model
from tools.runfolder import RunFolder, RunInfo
from tools.trial import Candidate, Status, Trial

ROOT = Path(__file__).resolve().parents[1]
SET = ROOT / "tests" / "problems"
MLP_ON_GEMV = {"MAX_M": 64, "act_at": "epilogue", "BLOCK_K": 32}  # every workload on the GEMVs
DECODE_ON_GEMV = {"MAX_M": 8, "act_at": "prologue", "BLOCK_K": 32}  # decode on the GEMVs, the rest on cuBLAS
# (model, region, template, params): each placement of act(g) * u and each MAX_M per template.
CASES = [("hf_llama", "MLP", "decode_mlp", MLP_ON_GEMV), ("hf_llama", "DecoderLayer", "decode_layer", DECODE_ON_GEMV),
         ("hf_qwen2", "MLP", "decode_mlp", DECODE_ON_GEMV), ("hf_qwen2", "DecoderLayer", "decode_layer", MLP_ON_GEMV),
         ("hf_qwen3", "MLP", "decode_mlp", MLP_ON_GEMV), ("hf_qwen3", "DecoderLayer", "decode_layer", DECODE_ON_GEMV),
         ("hf_mistral", "MLP", "decode_mlp", DECODE_ON_GEMV),
         ("hf_mistral", "DecoderLayer", "decode_layer", MLP_ON_GEMV),
         ("hf_gemma", "MLP", "decode_mlp", DECODE_ON_GEMV), ("hf_gemma", "DecoderLayer", "decode_layer", MLP_ON_GEMV),
         ("hf_phi3", "MLP", "decode_mlp", DECODE_ON_GEMV),  # one packed gate_up_proj
         ("hf_phi3", "DecoderLayer", "decode_layer", MLP_ON_GEMV),
         ("hf_gpt2", "MLP", "decode_ffn", DECODE_ON_GEMV)]  # GPT-2's plain MLP on Conv1D weights
PREFIX = {"hf_qwen2": "Qwen2", "hf_qwen3": "Qwen3", "hf_gpt2": "GPT2"}
HELD_OUT = ("hf_gemma", "hf_phi3")  # none of the five: written next to the test by the fixture


def phi3_source() -> str:
    """transformers' Phi3Model served as hf_llama.py serves Llama (its special tokens inside the
    small vocabulary): its MLP packs gate and up into one gate_up_proj."""
    return (SET / "hf_llama.py").read_text().replace("Llama", "Phi3").replace(
        "max_position_embeddings=256))", "max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=1))")


def gemma_source() -> str:
    """transformers' GemmaModel served as hf_llama.py serves Llama, its norm weights moved off
    transformers' zero init (1 + 0 would not tell Gemma's norm from one scaling by 1)."""
    return (SET / "hf_llama.py").read_text().replace("Llama", "Gemma") + textwrap.dedent('''

        class Model(Model):
            def __init__(self, layers: int = LAYERS):
                super().__init__(layers)
                with torch.no_grad():
                    for i, (name, p) in enumerate(self.model.named_parameters()):
                        if name.endswith("norm.weight"):
                            p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(i))
        ''')


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """{(model, class): problem} for each model's MLP and decoder layer, one runner for all."""
    base = tmp_path_factory.mktemp("decode")
    (base / "models").mkdir()
    (base / "models" / "hf_gemma.py").write_text(gemma_source())
    (base / "models" / "hf_phi3.py").write_text(phi3_source())
    problems = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for stem in dict.fromkeys(c[0] for c in CASES):
            file = base / "models" / f"{stem}.py" if stem in HELD_OUT else SET / f"{stem}.py"
            loaded = load_model(file, "cpu")
            prefix = PREFIX.get(stem, stem[3:].capitalize())
            regions = [RegionChoice(prefix + c[1]) for c in CASES if c[0] == stem]
            frozen, skipped = freeze(loaded, regions, base / stem / "problems", torch.device("cpu"))
            assert not skipped, skipped
            problems.update({(stem, p.region_class.removeprefix(prefix)): (p, base / stem / "problems") for p in frozen})
    runner = TrialRunner("cpu")
    for p, folder in problems.values():
        runner.add_problem(folder / p.name)
    yield problems, runner
    runner.close()


def _candidate(problem, name: str, params: dict) -> tuple[dict, str]:
    template, binding = next((t, b) for t, b in applicable(problem) if t.name == name)
    return binding, render(template, binding, {**default_params(template),
                                               **{k: v for k, v in params.items() if k in template.space}})


def _verdict(runner, problem, source: str, name: str):
    return runner.run(Candidate(region=problem.name, source=source, planner="template", template=name), do_time=False)


@pytest.mark.parametrize("stem, region, name, params", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_the_decode_fused_template_passes_the_verifier_on_every_workload(hf, stem, region, name, params):
    problems, runner = hf
    problem, _ = problems[(stem, region)]
    assert {w.name for w in problem.workloads} == {"prefill", "decode", "small_batch"}
    _, source = _candidate(problem, name, params)
    trial = _verdict(runner, problem, source, name)
    assert trial.status is Status.ok, (trial.status, trial.reason[:2000])


def test_the_layer_binding_comes_from_the_trace_and_knows_gemma(hf):
    """Norms in order, the MLP's roles inside the layer, the attention child as mixer1; Gemma's
    (1 + w) norms and GELU-tanh gate read from the trace, Llama's plain ones."""
    problems, _ = hf
    llama, _ = _candidate(problems[("hf_llama", "DecoderLayer")][0], "decode_layer", {})
    assert (llama["norm1"], llama["norm2"], llama["mixer1"], llama["mixer2"]) == \
        ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
    assert (llama["gate_w"], llama["act"], llama["unit_offset"]) == ("mlp.gate_proj.weight", "silu", False)
    gemma, _ = _candidate(problems[("hf_gemma", "DecoderLayer")][0], "decode_layer", {})
    assert (gemma["act"], gemma["unit_offset"]) == ("gelu_tanh", True)


@pytest.mark.parametrize("broken, params, verdict", [
    ("residual", DECODE_ON_GEMV, Status.wrong),
    ("norm", MLP_ON_GEMV, Status.ignored_parameter),
    ("norm", DECODE_ON_GEMV, Status.ignored_parameter)],
    ids=["residual", "norm-every-workload-fused", "norm-decode-only-fused"])
def test_the_verifier_rejects_a_decode_path_that_drops_a_fusion(hf, broken, params, verdict):
    """The checks can fail: the fused path without the second residual add is wrong; without the
    post-attention norm's weight (ones at init) it is caught once the parameters move, also where
    only decode takes the fused path (the parameters are moved on every input set)."""
    problems, runner = hf
    problem, _ = problems[("hf_llama", "DecoderLayer")]
    _, source = _candidate(problem, "decode_layer", params)
    edit = {"residual": (", res=h)", ")"), "norm": ("norm = (rstd, w2,", "norm = (rstd, torch.ones_like(w2),")}[broken]
    assert source.count(edit[0]) >= 1
    trial = _verdict(runner, problem, source.replace(edit[0], edit[1]), "decode_layer")
    assert trial.status is verdict, (trial.status, trial.reason[:500])


CHECK = textwrap.dedent('''
    import json, sys
    import torch
    from tools.modelfile import load_model
    fresh = lambda w: [t.clone() if torch.is_tensor(t) else t for t in w.inputs]  # the caches are written in place
    ref = load_model(sys.argv[1], "cpu", check_forward=False)
    decode = next(w for w in ref.workloads if w.name == "decode")
    keys = list(ref.model.state_dict())
    torch.manual_seed(0)
    moved = {k: v + 0.01 * torch.randn_like(v) for k, v in ref.model.state_dict().items()}
    with torch.no_grad():
        ref.model.load_state_dict(moved, strict=True)
        want = ref.model(*fresh(decode))  # before the patched file routes transformers' classes in this process
        new = load_model(sys.argv[2], "cpu", check_forward=False)
        layer = new.model.model.layers[0]
        out = {"routed": [getattr(type(m).forward, "__nightshift_region__", None) for m in (layer, layer.mlp)]}
        new.model(*fresh(decode))  # builds the cached [gate; up] weight
        out["cached"] = "_ns_wgu" in vars(layer)
        out["keys_same"] = list(new.model.state_dict()) == keys
        new.model.load_state_dict(moved, strict=True)  # an original checkpoint, into the patched model
        got = new.model(*fresh(decode))
    out["error"] = float((want - got).abs().max())
    print(json.dumps(out))
''')


def test_applied_concatenating_winners_keep_the_state_dict_and_say_so(hf, tmp_path):
    """`agent apply` of decode_layer and decode_mlp winners (each caches a [gate; up] weight): the
    patch says so in a line; the patched model's state_dict() keys are the original ones, an
    original state dict loads with strict=True, and the cached weights follow it."""
    problems, _ = hf
    model = tmp_path / "model" / "hf_llama.py"
    model.parent.mkdir()
    model.write_text((SET / "hf_llama.py").read_text())
    folder = problems[("hf_llama", "MLP")][1]
    run = tmp_path / "runs" / "hf-llama"
    shutil.copytree(folder, run / "problems")
    shutil.copy(folder.parent / "seal.json", run / "seal.json")  # the frozen files' seal goes along
    rf = RunFolder(run)
    rf.write_info(RunInfo(run_id=run.name, model_file=str(model), model_hash=file_sha256(model), device="cpu"))
    store = rf.store()
    for region, name, params in (("MLP", "decode_mlp", MLP_ON_GEMV), ("DecoderLayer", "decode_layer", DECODE_ON_GEMV)):
        problem, _ = problems[("hf_llama", region)]
        _, source = _candidate(problem, name, params)
        digest = Candidate(region=problem.name, source=source).hash
        store.record(Trial(region=problem.name, candidate_hash=digest, candidate_path=str(rf.save_candidate(source, digest)),
                           status=Status.ok, speedup=1.5, error=1e-8, tolerance="abs 0.0001", device="cpu",
                           generation="cpu"))
    store.close()
    result = apply_run(run)
    assert {r["region"] for r in result.regions} >= {"LlamaMLP", "LlamaDecoderLayer"}, (result.regions, result.skipped)
    said = [ln for ln in result.patch.splitlines() if "state_dict() keys stay the original ones" in ln]
    assert len(said) == 1 and "LlamaMLP" in said[0] and "LlamaDecoderLayer" in said[0], result.patch
    _, new = patched_lines(model.read_text(), Path(result.kernels_module).name, run.name, model,
                           [r["region"] for r in result.regions])
    patched = model.with_name("hf_llama_patched.py")
    patched.write_text("".join(new))
    done = subprocess.run([sys.executable, "-c", CHECK, str(model), str(patched)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                                                      "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["routed"] == ["LlamaDecoderLayer", "LlamaMLP"] and out["cached"] and out["keys_same"], out
    assert out["error"] < 1e-4, out
