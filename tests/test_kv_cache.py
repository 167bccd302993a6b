"""Traffic the model will serve (issue 17): KV-cache workloads of the example, the cache as a
declared in-place output the verifier compares with the original's, the cache templates under
Triton's interpreter, and a request trace grouped into weighted shapes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agent.planners.library import TEMPLATES, applicable, default_params, render
from sandbox.client import WorkerConfig
from sandbox.runner import Limits, TrialRunner
from tools.problem import Problem
from tools.traffic import TraceError, group, parse_line, read_trace
from tools.trial import Candidate, Status

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "llama.py"
TRACES = ROOT / "examples" / "traces"


@pytest.fixture(scope="module")
def attention_problem(tmp_path_factory, small_env):
    """The small example's LlamaAttention, frozen with its KV-cache workloads (float32)."""
    from tools.capture import RegionChoice, freeze
    from tools.modelfile import load_model
    folder = tmp_path_factory.mktemp("kv") / "problems"
    os.environ["LLAMA_DTYPE"] = "float32"
    try:
        loaded = load_model(EXAMPLE, "cpu")
        problems, skipped = freeze(loaded, [RegionChoice("LlamaAttention")], folder, torch.device("cpu"))
    finally:
        os.environ.pop("LLAMA_DTYPE", None)
    assert not skipped, skipped
    return folder / problems[0].name


def test_cache_is_frozen_before_the_call_and_declared(attention_problem):
    p = Problem.load(attention_problem)
    assert p.inplace_inputs == ["args.1", "args.2"]
    inputs, _, _ = p.load_tensors(attention_problem)
    decode = inputs[[w.name for w in p.workloads].index("decode")]
    k_cache, cache_len = decode["args"][1], decode["args"][3]
    assert cache_len == 255 and k_cache.shape[2] == 256
    assert k_cache[:, :, 255].abs().max() == 0  # the new position is not yet written
    assert k_cache[:, :, :255].abs().max() > 0


def test_decode_over_cache_matches_one_long_prefill(small_env, monkeypatch):
    """A token decoded over the cache sees what the same token sees at the end of a prefill."""
    monkeypatch.setenv("LLAMA_DTYPE", "float64")
    from tools.modelfile import import_model_file
    llama = import_model_file(EXAMPLE)
    model = llama.Model(1).eval()
    x, k, v, _ = llama.cache_inputs(2, 9, 0, seed=5)
    with torch.no_grad():
        full = model(x, k, v, 0)
        k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
        model(x[:, :6], k2, v2, 0)
        chunk = model(x[:, 6:8], k2, v2, 6)
        last = model(x[:, 8:], k2, v2, 8)
    assert torch.allclose(chunk, full[:, 6:8], atol=1e-10) and torch.allclose(last, full[:, 8:], atol=1e-10)
    assert torch.allclose(k2, k, atol=1e-12)


def _cache_binding(problem_dir: Path):
    p = Problem.load(problem_dir)
    found = [(t, b) for t, b in applicable(p) if t.name == "decode_attention"]
    assert found, "the decode-over-cache template does not apply to the cache attention"
    return p, found[0][1]


CHECK = """
import sys, torch
from pathlib import Path
from tools.problem import Problem
from tools.region import build_region, call_args
folder, source, only = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split(",")
ns = {}
exec(compile(source.read_text(), str(source), "exec"), ns)
p = Problem.load(folder)
inputs, _, state = p.load_tensors(folder)
region = build_region(Path(p.model_file), p.region_path, state, torch.device("cpu"))
for i, w in enumerate(p.workloads):
    if w.name not in only:
        continue
    args, kwargs = call_args(inputs[i], torch.device("cpu"))
    ref_args, _ = call_args(inputs[i], torch.device("cpu"))
    with torch.no_grad():
        out, ref = ns["forward"](region, *args, **kwargs), region(*ref_args)
    err = float((out - ref).abs().max())
    assert err < 1e-4, (w.name, err)
    assert torch.equal(args[1], ref_args[1]) and torch.equal(args[2], ref_args[2]), w.name
    print(w.name, err)
"""


@pytest.mark.parametrize("name, workloads", [("decode_attention", "decode,small_batch"),
                                             ("prefill_attention", "prefill,small_batch")])
def test_cache_templates_match_eager_under_the_interpreter(attention_problem, tmp_path, name, workloads):
    """Rendered and run under TRITON_INTERPRET=1 (set before triton is imported): the outputs
    and the written cache agree with the original's."""
    p, binding = _cache_binding(attention_problem)
    source = tmp_path / f"{name}.py"
    source.write_text(render(TEMPLATES[name], binding, default_params(TEMPLATES[name])))
    (tmp_path / "check.py").write_text(CHECK)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "LLAMA_DTYPE": "float32"}
    res = subprocess.run([sys.executable, str(tmp_path / "check.py"), str(attention_problem), str(source), workloads],
                         capture_output=True, text=True, env=env, timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    assert set(line.split()[0] for line in res.stdout.splitlines()) == set(workloads.split(","))


STALE = '''
import torch, torch.nn.functional as F
def forward(module, x, k_cache=None, v_cache=None, cache_len=0):
    work_k, work_v = k_cache.clone(), v_cache.clone()  # attends right, never writes the cache
    return type(module).forward(module, x, work_k, work_v, cache_len)
'''
WRONG_POSITIONS = '''
import torch
def forward(module, x, k_cache=None, v_cache=None, cache_len=0):
    out = type(module).forward(module, x, k_cache, v_cache, cache_len)
    if cache_len > 0:  # also scribbles over a cached position the original leaves alone
        k_cache[:, :, 0] = 0.5
    return out
'''
HONEST_EAGER = '''
def forward(module, x, k_cache=None, v_cache=None, cache_len=0):
    return type(module).forward(module, x, k_cache, v_cache, cache_len)
'''


@pytest.fixture(scope="module")
def cache_runner(attention_problem):
    r = TrialRunner("cpu", Limits(compile_s=60, run_s=30, time_s=60, budget_ms=50, max_reps=5),
                    WorkerConfig(device="cpu", memory_gb=6))
    r.add_problem(attention_problem)
    yield r
    r.close()


@pytest.mark.parametrize("source, status, why", [
    (HONEST_EAGER, Status.ok, "within tolerance"),
    (STALE, Status.wrong, "left stale or written wrong"),
    (WRONG_POSITIONS, Status.mutated_input, "leaves as they were are changed"),
])
def test_cache_as_declared_inplace_output(cache_runner, attention_problem, source, status, why):
    p = Problem.load(attention_problem)
    trial = cache_runner.run(Candidate(region=p.name, source=source), do_time=False)
    assert trial.status is status, (trial.status, trial.reason, trial.error_text[-600:])
    assert why in trial.reason
    # The reference worker found which workloads' caches the original writes, and their contents after
    effects = cache_runner.reference.problems[p.name].effects
    decode = [w.name for w in p.workloads].index("decode")
    assert effects["mutates_inputs"][decode] and effects["post_inputs"][decode] is not None


def test_decode_template_passes_the_verifier_and_a_wrong_guess_does_not(cache_runner, attention_problem):
    p = Problem.load(attention_problem)
    t = TEMPLATES["decode_attention"]
    right, swapped = [b for tt, b in applicable(p) if tt is t]
    assert (right["k_w"], right["v_w"]) == ("k_proj.weight", "v_proj.weight") and swapped["k_w"] == "v_proj.weight"
    trial = cache_runner.run(Candidate(region=p.name, source=render(t, right, default_params(t))), do_time=False)
    assert trial.status is Status.ok, (trial.reason, trial.error_text[-800:])
    trial = cache_runner.run(Candidate(region=p.name, source=render(t, swapped, default_params(t))), do_time=False)
    assert trial.status is Status.wrong, trial.reason


# -- traces ----------------------------------------------------------------------------------
def _req(t, prompt, out, prefix=0):
    return parse_line(json.dumps({"arrival_s": t, "prompt_tokens": prompt, "output_tokens": out,
                                  "shared_prefix_tokens": prefix}), "test")


def test_trace_grouping_into_named_weighted_shapes():
    reqs = [_req(0, 16000, 10), _req(1, 16500, 20, 16000), _req(2, 2000, 100, 300), _req(3, 2100, 100, 300)]
    shapes = {s.name: s for s in group(reqs)}
    assert set(shapes) == {"long_prefill", "turn_prefill", "prefill", "decode", "long_decode"}
    assert (shapes["long_prefill"].batch, shapes["long_prefill"].new_tokens) == (1, 16000)
    assert shapes["turn_prefill"].context == 15872 and shapes["turn_prefill"].new_tokens == 512
    assert shapes["prefill"].weight == pytest.approx((1700 + 1800) / shapes["prefill"].new_tokens)
    decode = shapes["decode"]
    assert decode.new_tokens == 1 and (decode.context + 1) % 256 == 0 and decode.tokens == 200
    assert decode.weight == pytest.approx(200 / decode.batch)


def test_shipped_traces_group_into_few_shapes():
    agent, chat = group(read_trace(TRACES / "agent.jsonl")), group(read_trace(TRACES / "chat.jsonl"))
    assert 2 <= len(agent) <= 5 and 2 <= len(chat) <= 5
    assert {s.name for s in agent} >= {"long_prefill", "long_decode", "turn_prefill"}
    assert max(s.context for s in agent) > max(s.context for s in chat)
    assert all(s.weight > 0 for s in agent + chat)


@pytest.mark.parametrize("line, message", [
    ("not json", "not JSON"),
    ('{"arrival_s": 0, "prompt_tokens": 10}', "missing 'output_tokens'"),
    ('{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": -1}', "output_tokens must be an integer >= 0"),
    ('{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 1, "shared_prefix_tokens": 10}', "must be below"),
    ('[1, 2]', "must be a JSON object"),
])
def test_bad_trace_lines_are_named(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 1}\n\n' + line + "\n")
    with pytest.raises(TraceError, match=message) as e:
        read_trace(path)
    assert f"{path}:3" in str(e.value)


def test_cli_bad_trace_exits_nonzero_with_the_line(tmp_path, small_env):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0, "prompt_tokens": "many", "output_tokens": 1}\n')
    res = subprocess.run([sys.executable, "-m", "agent", "profile", "--model", str(EXAMPLE), "--device", "cpu",
                          "--workloads", str(bad), "--runs-dir", str(tmp_path / "runs"), "--no-freeze"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode != 0
    assert f"{bad}:1: prompt_tokens must be an integer" in res.stderr + res.stdout
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_trace_workloads_replace_the_models_own(small_env):
    from tools.modelfile import load_model
    loaded = load_model(EXAMPLE, "cpu", trace=TRACES / "agent.jsonl", check_forward=False)
    by_name = {w.name: w for w in loaded.workloads}
    shapes = {s.name: s for s in group(read_trace(TRACES / "agent.jsonl"))}
    assert set(by_name) == set(shapes)
    assert all(by_name[n].weight == shapes[n].weight for n in shapes)
    decode = by_name["long_decode"].inputs
    assert decode[0].shape[:2] == (shapes["long_decode"].batch, 1) and decode[3] == decode[1].shape[3] - 1


def test_report_weighted_total_is_what_the_mix_costs():
    from agent.report.numbers import weighted_totals
    from tools.e2e import IntegrationResult, WorkloadResult
    res = IntegrationResult(device="cuda", workloads=[
        WorkloadResult(name="long_decode", weight=100.0, eager_ms=2.0, tuned_ms=1.0,
                       baselines={"compile:default": 1.5, "compile:reduce-overhead": None}),
        WorkloadResult(name="long_prefill", weight=2.0, eager_ms=50.0, tuned_ms=40.0,
                       baselines={"compile:default": 45.0, "compile:reduce-overhead": 30.0})])
    totals = dict(weighted_totals(res))
    assert totals == {"eager": 300.0, "nightshift": 180.0, "compile:default": 240.0, "compile:reduce-overhead": None}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cache_templates_at_llama_8b_sizes_in_bf16_on_gpu(tmp_path, monkeypatch):
    """Full preset, one layer, bf16: both cache templates within the default tolerance on every
    workload, the cache written like the original; their times against eager printed."""
    from triton.testing import do_bench
    from tools.capture import RegionChoice, freeze
    from tools.modelfile import load_model
    from tools.problem import default_tolerance
    from tools.region import build_region, call_args
    monkeypatch.setenv("LLAMA_PRESET", "full")
    monkeypatch.setenv("LLAMA_LAYERS", "1")
    monkeypatch.delenv("LLAMA_DTYPE", raising=False)
    dev = torch.device("cuda")
    (p,), skipped = freeze(load_model(EXAMPLE, dev), [RegionChoice("LlamaAttention")], tmp_path / "problems", dev)
    folder = tmp_path / "problems" / p.name
    inputs, reference, state = p.load_tensors(folder)
    region = build_region(Path(p.model_file), p.region_path, state, dev)
    failures = []
    for name in ("decode_attention", "prefill_attention"):
        t = TEMPLATES[name]
        binding = next(b for tt, b in applicable(p) if tt is t)
        path = tmp_path / f"{name}.py"
        path.write_text(render(t, binding, default_params(t)))
        ns: dict = {}
        exec(compile(path.read_text(), str(path), "exec"), ns)
        for i, w in enumerate(p.workloads):
            args, _ = call_args(inputs[i], dev)
            ref_args, _ = call_args(inputs[i], dev)
            with torch.no_grad():
                out, ref = ns["forward"](region, *args), region(*ref_args)
                tol = default_tolerance(ref.dtype, float(ref.abs().max()))
                err = tol.error(float((out.float() - ref.float()).abs().max()), float(ref.abs().max()))
                cache_err = float((args[1].float() - ref_args[1].float()).abs().max())
                eager = do_bench(lambda: region(*ref_args))
                cand = do_bench(lambda: ns["forward"](region, *args))
            print(f"\n{name:18s} {w.name:13s} err {err:.2e} ({tol}) cache {cache_err:.1e} "
                  f"eager {eager:.3f} ms cand {cand:.3f} ms x{eager / cand:.2f}")
            if err > tol.value or cache_err > 0:
                failures.append((name, w.name, err, cache_err))
    assert not failures, failures


def test_a_timed_repetition_writes_its_cache_at_one_address_and_draws_everything_else_anew():
    """A served model's KV cache lives at a fixed address (CUDA graphs re-record for a new one):
    from the second repetition on, an input the call wrote into keeps its memory, its fresh
    values copied in; every other input is new memory each repetition."""
    from sandbox import worker_tensors as T
    base_args, base_kwargs = [torch.randn(2, 8), torch.zeros(2, 16, 8)], {}
    make = T.WrittenInPlace(lambda j: T.vary_set(base_args, base_kwargs, 100 + j))
    seen = []
    for j in range(4):
        (x, cache), _ = make(j)
        want = T.vary_set(base_args, base_kwargs, 100 + j)[0]
        assert torch.equal(x, want[0]) and torch.equal(cache, want[1])  # the fresh values, wherever they live
        seen.append((x.data_ptr(), cache.data_ptr()))
        cache[:, :2] = x.unsqueeze(1)  # the call writes its new tokens into the cache
    assert len({c for _, c in seen[1:]}) == 1
    assert make.kept and set(make.kept) == {1}  # the cache, and only the cache, is kept
    # The worker's next timed run of this input set (another seed) keeps the same address.
    make.draw = lambda j: T.vary_set(base_args, base_kwargs, 200 + j)
    (x, cache), _ = make(0)
    assert cache.data_ptr() == seen[-1][1] and torch.equal(cache, T.vary_set(base_args, base_kwargs, 200)[0][1])


def test_the_worker_keeps_a_cache_at_one_address_across_its_timed_runs():
    """Across the worker's runs of one input set (rounds of a few repetitions each, as a slow
    call gets), not only within one: else reduce-overhead re-records its graphs every round."""
    from sandbox import worker as W
    from tools import timing
    w = W.Worker.__new__(W.Worker)
    w.torch, w.role, w.device, w.clock, w.in_place, w.kept = torch, "reference", torch.device("cpu"), None, {}, []
    w.base_sets, w.snapshots = {}, {}

    def fwd(region, x, cache):
        cache[:, :2] = x.unsqueeze(1)  # writes its new tokens into the cache
        return cache.sum(1)
    w.problems = {"p": {"region": torch.nn.Identity(), "forward": fwd,
                        "inputs": [{"args": [torch.randn(2, 8), torch.zeros(2, 16, 8)], "kwargs": {}}]}}
    w._copy_outputs = lambda out, snaps: ([out.clone()], None)
    caches, real = [], timing.run_batch

    def spy(call, make, reps, *a, **k):
        def drawn(j):
            args, kwargs = make(j)
            caches.append(args[1].data_ptr())
            return args, kwargs
        return real(call, drawn, reps, *a, **k)
    timing.run_batch = spy
    try:
        for seed in (1, 2, 3):
            w.op_batch({"problem": "p", "set": 0, "seed": seed, "reps": 2}, None)
    finally:
        timing.run_batch = real
    assert len(caches) == 6 and len(set(caches[1:])) == 1, caches  # new memory only on the very first call


def test_a_timed_input_set_is_copied_to_the_device_once_per_candidate():
    """The frozen set goes to the device in the first timed run and stays (runs only draw from
    it): a copy from host memory per run was most of a decode run's wall on the H200, and its
    jitter between workers got honest kernels refused. A new candidate gets a fresh copy."""
    from sandbox import worker as W
    w = W.Worker.__new__(W.Worker)
    w.torch, w.role, w.device, w.clock, w.in_place, w.kept = torch, "reference", torch.device("cpu"), None, {}, []
    w.base_sets, w.snapshots, w.candidate, w.verified = {}, {}, None, None
    w.problems = {name: {"region": torch.nn.Identity(), "forward": lambda region, x: x * 2} for name in "pq"}
    copies = []

    def device_set(p, i):  # the copy to a GPU (on the CPU the frozen tensors themselves are drawn from)
        copies.append(i)
        return [torch.randn(4, 8)], {}
    w._draw_base = device_set
    w._copy_outputs = lambda out, snaps: ([out.clone()], None)
    for seed in (1, 2, 3):
        head, _ = w.op_batch({"problem": "p", "set": 0, "seed": seed, "reps": 2}, None)
        assert head["upload_ms"] >= 0
    assert copies == [0]
    for i in range(1, W.BASE_SETS + 1):  # more sets than it keeps: the oldest, set 0, goes
        w.op_batch({"problem": "q", "set": i, "seed": 1, "reps": 1}, None)
    w.op_batch({"problem": "p", "set": 0, "seed": 4, "reps": 1}, None)
    assert copies == [0, 1, 2, 3, 4, 0] and len(w.base_sets) == W.BASE_SETS
    w.release()
    assert w.base_sets == {}


COMPOSED_WITH_CACHE = r'''
import copy, importlib.util, sys
import torch
spec = importlib.util.spec_from_file_location("llama", sys.argv[1]); L = importlib.util.module_from_spec(spec)
sys.modules["llama"] = L; spec.loader.exec_module(L)
from agent.review.ways import composed_candidate
from tools.problem import Problem
own = "def forward(module, *args, **kwargs):\n    return type(module).forward(module, *args, **kwargs)\n"
c = composed_candidate([(Problem.model_construct(name="LlamaAttention", region_class="LlamaAttention"), own)], None)
spec = importlib.util.spec_from_file_location("composed", sys.argv[2]); open(sys.argv[2], "w").write(c.source)
C = importlib.util.module_from_spec(spec); sys.modules["composed"] = C; spec.loader.exec_module(C)
torch.manual_seed(0)
model = L.Model(*L.get_init_inputs())
for name, w in L.get_workloads().items():  # the third shape on: a recompile
    mine, theirs = copy.deepcopy(w["inputs"]), copy.deepcopy(w["inputs"])
    with torch.no_grad():
        out = (C.forward(model, *mine) - model(*theirs)).abs().max().item()
    cache = max((a - b).abs().max().item() for a, b in zip(mine[1:3], theirs[1:3]))
    print(name, out, cache)
'''


def test_our_ops_inside_torch_compile_write_every_layers_cache_on_every_shape(tmp_path):
    """Two layers' attention as opaque ops writing into views of one KV cache, under
    torch.compile: its dynamic-shape graphs (the third workload shape on) left the caches wrong
    (the H200 refused every nightshift + <mode> way of the example so), where static shapes are
    right. Each shape, output and cache as the eager model gives them."""
    script = tmp_path / "composed_with_cache.py"
    script.write_text(COMPOSED_WITH_CACHE)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LLAMA_PRESET": "small", "LLAMA_LAYERS": "2",
           "LLAMA_DTYPE": "float32"}
    got = subprocess.run([sys.executable, str(script), str(EXAMPLE), str(tmp_path / "composed.py")], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    rows = [line.split() for line in got.stdout.splitlines()]
    assert [r[0] for r in rows] == ["prefill", "decode", "long_prefill", "small_batch"], got.stdout
    for name, out, cache in rows:
        assert float(out) < 1e-4 and float(cache) < 1e-4, got.stdout
