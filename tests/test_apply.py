"""`agent apply RUN`: the winners as one kernels module next to the model, and a patch that
routes the model through it. Checked the way a user would: the patch goes through `git apply`
in a fresh repository, the patched model is imported (by nightshift's loader and by plain
`import`) and run under Triton's interpreter, and its outputs match the untouched model."""

import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from agent.apply import Winner, apply_run, kernels_module_text
from agent.setup.jobs import UserError
from tools.e2e import AcceptedRegion, DroppedCandidate, IntegrationResult
from tools.modelfile import file_sha256
from tools.problem import Problem
from tools.runfolder import RunFolder, RunInfo
from tools.trial import Candidate, Status, Trial

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "llama.py"
CANDIDATES = ROOT / "tests" / "candidates"
RMSNORM = (CANDIDATES / "rmsnorm_triton.py").read_text()
MLP = (CANDIDATES / "mlp_silu_mul_triton.py").read_text()
ENV = {"PYTHONPATH": str(ROOT), "LLAMA_PRESET": "small", "LLAMA_LAYERS": "1", "TRITON_INTERPRET": "1"}


def _record(folder: RunFolder, region: str, source: str, status: Status, speedup: float | None) -> str:
    c = Candidate(region=region, source=source)
    path = folder.save_candidate(source, c.hash)
    store = folder.store()
    store.record(Trial(region=region, candidate_hash=c.hash, candidate_path=str(path), status=status,
                       speedup=speedup, error=2e-7 if status is Status.ok else 0.5, tolerance="abs 0.0001",
                       device="cpu", generation="cpu"))
    store.close()
    return c.hash


def make_run(dest: Path, problems: Path) -> tuple[Path, Path]:
    """A copy of the example model in its own folder and a run over it: two kept RMSNorm
    candidates (the faster one must win), one kept MLP candidate, a rejected attention one."""
    model = dest / "model" / "llama.py"
    model.parent.mkdir(parents=True)
    shutil.copy(EXAMPLE, model)
    run = dest / "runs" / "llama-test"
    shutil.copytree(problems, run / "problems")
    shutil.copy(problems.parent / "seal.json", run / "seal.json")  # the frozen files' seal goes along
    folder = RunFolder(run)
    folder.write_info(RunInfo(run_id=run.name, model_file=str(model), model_hash=file_sha256(model), device="cpu"))
    _record(folder, "LlamaRMSNorm", RMSNORM + "\n# a slower variant\n", Status.ok, 1.2)
    _record(folder, "LlamaRMSNorm", RMSNORM, Status.ok, 2.5)
    _record(folder, "LlamaMLP", MLP, Status.ok, 1.1)
    _record(folder, "LlamaAttention", "def forward(module, x):\n    return x\n", Status.wrong, None)
    return run, model


def agent(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **ENV})


def git(cwd: Path, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env)


@pytest.fixture
def fresh(tmp_path, frozen_run):
    return make_run(tmp_path, frozen_run)


@pytest.fixture(scope="module")
def applied(tmp_path_factory, frozen_run):
    """`agent apply RUN --json` once, through the CLI."""
    run, model = make_run(tmp_path_factory.mktemp("applied"), frozen_run)
    result = agent("apply", run, "--json")
    assert result.returncode == 0, result.stderr
    return run, model, json.loads(result.stdout)


def _top_level_names(tree: ast.Module) -> list[str]:
    names = []
    for s in tree.body:
        if isinstance(s, (ast.FunctionDef, ast.ClassDef)):
            names.append(s.name)
        elif isinstance(s, ast.Assign):
            names += [t.id for t in s.targets if isinstance(t, ast.Name)]
        elif isinstance(s, (ast.Import, ast.ImportFrom)):
            names += [a.asname or a.name.split(".")[0] for a in s.names]
    return names


def test_apply_writes_one_kernels_module_and_a_patch(applied):
    run, model, data = applied
    kernels = model.parent / "llama_nightshift.py"
    assert data["kernels_module"] == str(kernels) and kernels.is_file()
    assert data["chosen_by"] == "store"
    assert [r["region"] for r in data["regions"]] == ["LlamaMLP", "LlamaRMSNorm"]  # the run's problem order
    rms = data["regions"][1]
    assert rms["candidate_hash"] == Candidate(region="", source=RMSNORM).hash and rms["speedup"] == 2.5
    assert "no kept candidate" in data["skipped"]["LlamaAttention"]
    patch = (run / "patches" / "llama.patch").read_text()
    assert patch == data["patch"] and patch.startswith("--- a/llama.py\n+++ b/llama.py\n")
    assert "+# nightshift: route tuned regions through llama_nightshift.py (run llama-test)" in patch
    assert "+_nightshift_install(globals())" in patch
    assert model.read_text() == EXAMPLE.read_text()  # the model file itself is only patched by the user

    text = kernels.read_text()
    tree = ast.parse(text)
    names = _top_level_names(tree)
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    for name in ("_LlamaRMSNorm__rmsnorm", "_LlamaMLP__silu_mul", "forward_LlamaRMSNorm", "forward_LlamaMLP",
                 "REGIONS", "CLASSES", "install"):
        assert name in names
    assert not {"forward", "_rmsnorm", "_silu_mul"} & set(names)
    defs = {s.name: s for s in tree.body if isinstance(s, ast.FunctionDef)}
    assert ast.unparse(defs["_LlamaRMSNorm__rmsnorm"].decorator_list[0]) == "triton.jit"
    fwd = ast.unparse(defs["forward_LlamaRMSNorm"])
    assert "_LlamaRMSNorm__rmsnorm[x2.shape[0]," in fwd and "module.weight" in fwd and "module.eps" in fwd
    assert "BLOCK=triton.next_power_of_2(n)" in fwd  # keyword names are not references
    assert "module._ns_gate_up" in ast.unparse(defs["forward_LlamaMLP"])  # attributes keep their names
    imports = [ast.unparse(s) for s in tree.body if isinstance(s, (ast.Import, ast.ImportFrom))]
    assert imports.count("import triton") == 1 and imports.count("import triton.language as tl") == 1
    assert "# LlamaRMSNorm (class LlamaRMSNorm): candidate " + rms["candidate_hash"] in text
    assert "# speedup 2.50x over the original forward" in text and "# run llama-test:" in text
    assert "REGIONS = {'LlamaMLP': forward_LlamaMLP, 'LlamaRMSNorm': forward_LlamaRMSNorm}" in text


CHECK = textwrap.dedent('''
    import json, os, sys
    import torch
    from tools.modelfile import load_model
    original, patched = sys.argv[1], sys.argv[2]
    ref = load_model(original, "cpu", check_forward=False)
    new = load_model(patched, "cpu", check_forward=False)
    sys.path.insert(0, os.path.dirname(patched))
    import llama  # plain import as well: a second module object, routed on its own
    plain = llama.Model(1).eval()
    out = {"routed": {}, "errors": {}}
    for label, m in (("loader", new.model), ("import", plain)):
        layer = m.layers[0]
        out["routed"][label] = {name: getattr(type(getattr(layer, name)).forward, "__nightshift_region__", None)
                                for name in ("input_layernorm", "mlp", "self_attn")}
    fwd = type(new.model.norm).forward
    kernels = sys.modules[fwd.__module__]
    out["kernels_file"] = kernels.__file__

    class Count:  # counts launches of the tuned RMSNorm kernel
        def __init__(self, kernel):
            self.kernel, self.n = kernel, 0
        def __getitem__(self, grid):
            self.n += 1
            return self.kernel[grid]
    kernels._LlamaRMSNorm__rmsnorm = counter = Count(kernels._LlamaRMSNorm__rmsnorm)
    # Every workload through the loaded model; the second module object on the decode step only
    # (its routing does not depend on the shape, and the interpreter makes each call cost seconds).
    decode = [w for w in ref.workloads if w.name == "decode"]
    with torch.no_grad():
        for label, m, workloads in (("loader", new.model, ref.workloads), ("import", plain, decode)):
            for w in workloads:
                a, b = ref.model(*w.inputs), m(*w.inputs)
                out["errors"][f"{label}/{w.name}"] = [float((a - b).abs().max()), float(a.abs().max())]
    out["launches"] = counter.n
    out["mlp_cached"] = hasattr(plain.layers[0].mlp, "_ns_gate_up")
    # Installing again leaves one routing, not a wrapper of a wrapper.
    again = llama._nightshift_install(vars(llama))
    original = llama.LlamaRMSNorm.forward.__nightshift_original__
    out["again"] = again
    out["original"] = [original.__module__, original.__qualname__]
    # Training with autograd keeps the original forward (the tuned kernels have no backward).
    x = ref.workloads[1].inputs[0]
    before = counter.n
    y = plain.train()(x)
    out["train"] = [counter.n - before, y.requires_grad]
    print(json.dumps(out))
''')


def test_patch_applies_with_git_and_routes_the_model(applied, frozen_run, tmp_path):
    run, model, data = applied
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    shutil.copy(model, repo / "src" / "llama.py")
    shutil.copy(data["kernels_module"], repo / "src" / "llama_nightshift.py")
    assert git(repo, "init", "-q").returncode == 0
    git(repo, "add", ".")
    assert git(repo, "commit", "-qm", "model").returncode == 0
    applied_ = git(repo / "src", "apply", str(run / "patches" / "llama.patch"))  # from the model's folder
    assert applied_.returncode == 0, applied_.stderr
    patched = repo / "src" / "llama.py"
    assert patched.read_text().startswith(EXAMPLE.read_text())  # appended, nothing else touched

    result = subprocess.run([sys.executable, "-c", CHECK, str(model), str(patched)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, env={**os.environ, **ENV})
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    for label in ("loader", "import"):
        assert out["routed"][label] == {"input_layernorm": "LlamaRMSNorm", "mlp": "LlamaMLP", "self_attn": None}
    assert out["kernels_file"] == str(repo / "src" / "llama_nightshift.py")
    tolerance = min((Problem.load(p).tolerance for p in frozen_run.iterdir()), key=lambda t: t.value)
    for key, (max_abs, ref_max) in out["errors"].items():
        assert tolerance.error(max_abs, ref_max) <= tolerance.value, (key, max_abs, tolerance)
    # (4 workloads + decode again) x 3 RMSNorms per forward (two per layer, one final), all through Triton.
    assert sorted(out["errors"]) == sorted([f"loader/{w}" for w in ("prefill", "decode", "long_prefill", "small_batch")]
                                           + ["import/decode"])
    assert out["launches"] == 15
    assert out["mlp_cached"]
    assert out["again"] == ["LlamaMLP", "LlamaRMSNorm"]
    assert out["original"] == ["llama", "LlamaRMSNorm.forward"]
    assert out["train"] == [0, True]


COMPILED = textwrap.dedent('''
    import json, sys
    import torch
    from tools.modelfile import load_model
    original, patched = sys.argv[1], sys.argv[2]
    ref, new = load_model(original, "cpu", check_forward=False), load_model(patched, "cpu", check_forward=False)
    kernels = sys.modules[type(new.model.norm).forward.__module__]
    first = new.workloads[0]
    compiled = kernels.compile_model(new.model, *first.inputs)
    first.restore()
    errors = {}
    with torch.no_grad():
        for w, r in zip(new.workloads, ref.workloads):
            errors[w.name] = float((compiled(*w.inputs) - ref.model(*r.inputs)).abs().max())
    from torch._dynamo.utils import counters
    ops = sorted(n for n in dir(torch.ops.nightshift) if n[-1].isdigit())
    print(json.dumps({"errors": errors, "breaks": sum(counters["graph_break"].values()), "ops": ops}))
''')


def test_the_applied_model_compiles_with_our_kernels_as_opaque_ops(applied, tmp_path):
    """`compile_model` of the kernels module: torch.compile of the patched model with each tuned
    forward (Triton RMSNorm and MLP, here under the interpreter) an opaque op, no graph break,
    the model's answers on every workload."""
    run, model, data = applied
    folder = tmp_path / "m"
    folder.mkdir()
    shutil.copy(model, folder / "llama.py")
    shutil.copy(data["kernels_module"], folder / "llama_nightshift.py")
    assert git(folder, "apply", str(run / "patches" / "llama.patch")).returncode == 0
    result = subprocess.run([sys.executable, "-c", COMPILED, str(model), str(folder / "llama.py")], cwd=tmp_path,
                            capture_output=True, text=True, timeout=600, env={**os.environ, **ENV})
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["breaks"] == 0 and len(out["ops"]) == 2, out  # one op for the RMSNorms, one for the MLP
    assert len(out["errors"]) == 4 and max(out["errors"].values()) < 1e-3, out["errors"]


def _files(root: Path) -> list[Path]:
    """Every file under root, but SQLite's own -wal/-shm files (a reader of a WAL store makes them)."""
    return sorted(p for p in root.rglob("*") if not p.name.endswith(("-wal", "-shm")))


def test_dry_run_prints_the_code_and_the_patch_and_writes_nothing(fresh):
    run, model = fresh
    before = _files(run.parent.parent)
    result = agent("apply", run, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "+# nightshift: route tuned regions through llama_nightshift.py (run llama-test)" in result.stdout
    assert f"would write {model.parent / 'llama_nightshift.py'}" in result.stdout
    assert f"would write {run / 'patches' / 'llama.patch'}" in result.stdout
    as_json = json.loads(agent("apply", run, "--dry-run", "--json").stdout)
    assert _files(run.parent.parent) == before
    assert model.read_text() == EXAMPLE.read_text()
    # The code it would write is shown, not only its file's name: the kernels themselves.
    code = as_json["kernels_module_source"]
    assert "def _LlamaRMSNorm__rmsnorm(" in code and "def install(" in code
    assert code.rstrip("\n") in result.stdout
    written = apply_run(run)
    assert Path(written.kernels_module).read_text() == code == written.kernels_module_source


def test_nothing_faster_is_a_verdict_and_allow_slower_warns_for_each(fresh):
    """A CPU run: integration found nothing faster. The dry run says why and how to see the patch
    anyway, exit 1 (a verdict, not an error); --allow-slower applies each with a warning, in --json too."""
    run, model = fresh
    slow = "not faster than the original beyond the noise band (best kept 1.11x)"
    IntegrationResult(device="cpu", timing_kind="cpu", dropped=[
        DroppedCandidate(region="LlamaRMSNorm", candidate_hash=Candidate(region="", source=RMSNORM).hash, reason=slow),
        DroppedCandidate(region="LlamaMLP", candidate_hash=Candidate(region="", source=MLP).hash, reason=slow)],
    ).save(run)
    result = agent("apply", run, "--dry-run")
    assert result.returncode == 1 and result.stderr == "", result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("nothing to apply: no region has a candidate faster than the original") and \
        "Not an error" in last and "--allow-slower" in last, last
    data = json.loads(agent("apply", run, "--dry-run", "--json").stdout)
    assert data["regions"] == [] and data["note"] == last
    result = agent("apply", run, "--dry-run", "--allow-slower", "--json")
    data = json.loads(result.stdout)
    assert result.returncode == 0 and [r["region"] for r in data["regions"]] == ["LlamaMLP", "LlamaRMSNorm"]
    assert len(data["warnings"]) == 2 and all("--allow-slower" in w for w in data["warnings"]), data["warnings"]
    assert {w.split(":")[0] for w in data["warnings"]} == {"LlamaMLP", "LlamaRMSNorm"}


def test_a_store_winner_inside_its_noise_band_is_not_faster(fresh):
    """Without integration.json the store's best decides: one inside its A/A band is no win."""
    run, model = fresh
    store = RunFolder(run).store()
    for t in store.trials():
        store.record(t.model_copy(update={"noise_band": 3.0}))  # every speedup here is within ±300%
    store.close()
    res = apply_run(run, ["LlamaMLP"])
    assert res.regions == [] and "inside its noise band" in res.skipped["LlamaMLP"], res.skipped
    slower = apply_run(run, ["LlamaMLP"], dry_run=True, allow_slower=True)
    assert [r["region"] for r in slower.regions] == ["LlamaMLP"] and len(slower.warnings) == 1, slower.warnings


def test_applying_twice_is_harmless(fresh):
    run, model = fresh
    first = apply_run(run)
    kernels = Path(first.kernels_module)
    module_text = kernels.read_text()
    assert first.patch and not first.already_applied
    again = apply_run(run)  # not applied yet: the same patch, the same module
    assert again.patch == first.patch and kernels.read_text() == module_text and not again.kernels_module_changed
    patched = git(model.parent, "apply", str(run / "patches" / "llama.patch"))
    assert patched.returncode == 0, patched.stderr
    patched_text = model.read_text()
    third = apply_run(run)
    assert third.already_applied and third.patch == "" and not third.warnings
    # The patch that applied is kept for the record, never overwritten with an empty one.
    assert (run / "patches" / "llama.patch").read_text() == first.patch
    assert str(run / "patches" / "llama.patch") not in third.written
    assert model.read_text() == patched_text and kernels.read_text() == module_text
    result = agent("apply", run)
    assert result.returncode == 0 and "already applied" in result.stdout, result.stderr
    assert (run / "patches" / "llama.patch").read_text() == first.patch


def test_region_filter_and_unknown_region(fresh):
    run, model = fresh
    data = json.loads(agent("apply", run, "--region", "LlamaMLP", "--json").stdout)
    assert [r["region"] for r in data["regions"]] == ["LlamaMLP"] and not data["skipped"]
    text = Path(data["kernels_module"]).read_text()
    assert "REGIONS = {'LlamaMLP': forward_LlamaMLP}" in text and "_rmsnorm" not in text

    none = agent("apply", run, "--region", "LlamaAttention")
    assert none.returncode == 1 and "LlamaAttention: not applied (no kept candidate" in none.stdout

    bad = agent("apply", run, "--region", "Nope")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "no region 'Nope'" in bad.stderr
    with pytest.raises(UserError, match="no region 'Nope'"):
        apply_run(run, ["Nope"])


def test_integration_json_decides_the_winners(fresh):
    run, model = fresh
    slower = Candidate(region="", source=RMSNORM + "\n# a slower variant\n").hash
    IntegrationResult(device="cpu", accepted=[AcceptedRegion(region="LlamaRMSNorm", candidate_hash=slower,
                                                             candidate_path="", region_speedup=1.2,
                                                             under_compile=["*"])],
                      dropped=[DroppedCandidate(region="LlamaMLP", candidate_hash="x",
                                                reason="end-to-end error 0.2 > tolerance")]).save(run)
    res = apply_run(run)
    assert res.chosen_by == "integration"
    assert [(r["region"], r["candidate_hash"]) for r in res.regions] == [("LlamaRMSNorm", slower)]
    assert "end-to-end error 0.2" in res.skipped["LlamaMLP"]
    assert "kept end to end by integration" in Path(res.kernels_module).read_text()
    # integration found torch.compile of the region as fast on every call: compile_model leaves it be
    assert "UNDER_COMPILE = {'LlamaRMSNorm': {'*'}}" in Path(res.kernels_module).read_text()
    assert any("under compile_model its own code runs on every call" in line for line in res.lines()[0])


def _load(path: Path):
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"merged_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_merge_renames_scope_aware(tmp_path):
    """Clashing names in two candidates; a parameter, a local and a comprehension variable that
    share a global's name; a nested function; `global`; an import rebound by the candidate."""
    a = textwrap.dedent('''
        """Candidate A."""
        import math
        import math as m
        SCALE = 2.0
        _calls = 0
        def _helper(x, SCALE=None):
            return x * (SCALE or 1)
        def forward(module, x):
            global _calls
            _calls += 1
            def inner(y):
                return _helper(y) * SCALE
            total = sum(SCALE for SCALE in (10, 20))
            return inner(x) + module.weight + total + m.floor(math.pi) + _calls
        ''')
    b = textwrap.dedent('''
        import math
        from os import path as m
        try:
            import json
        except ImportError:
            json = None
        SCALE = 3.0
        class _Helper:
            SCALE = 100
            def go(self, x):
                return x * SCALE
        def forward(module, x):
            return _Helper().go(x) + module.weight + len(json.dumps([m.sep]))
        ''')
    winners = [Winner("A", "ClassA", "a" * 16, a), Winner("B", "ClassB", "b" * 16, b)]
    text, parts, skipped = kernels_module_text(winners, "r1", "model.py", None)
    assert not skipped
    tree = ast.parse(text)
    names = _top_level_names(tree)
    assert len(names) == len(set(names))
    assert {"SCALE_A", "SCALE_B", "_A__helper", "_B__Helper", "forward_A", "forward_B", "_A__calls"} <= set(names)
    path = tmp_path / "merged.py"
    path.write_text(text)
    merged = _load(path)

    class Obj:
        weight = 1.0
    # A: inner(3) = 3 * 2 = 6 (param SCALE shadows nothing outside), total 30, floor(pi) 3, calls 1
    assert merged.REGIONS["A"](Obj(), 3.0) == 6 + 1 + 30 + 3 + 1
    assert merged.REGIONS["B"](Obj(), 3.0) == 9 + 1 + len('["/"]')
    assert merged.CLASSES == {"A": "ClassA", "B": "ClassB"}

    class ClassA:
        def forward(self, x):
            return "original"
    ns = {"ClassA": ClassA}
    with pytest.warns(UserWarning, match="no class ClassB"):
        assert merged.install(ns) == ["ClassA"]
    with pytest.warns(UserWarning):
        merged.install(ns)
    obj = ClassA()
    obj.weight, obj.training = 1.0, False
    assert obj.forward(3.0) == 6 + 1 + 30 + 3 + 2
    assert ClassA.forward.__nightshift_original__.__qualname__.endswith("ClassA.forward")
    assert text == kernels_module_text(winners, "r1", "model.py", None)[0]  # deterministic


class _Norm(torch.nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x, mask=None):
        return x * self.weight + self.eps


TUNED_NORM = textwrap.dedent('''
    def forward(module, x, mask=None):
        if mask is not None:
            raise NotImplementedError("mask was None when this candidate was verified")
        return x * module.weight + 1e-5 + 1000.0  # 1e-5 built in; +1000 shows which forward ran
    ''')


def test_applied_winners_run_only_where_they_were_verified(tmp_path):
    """An instance of the class unlike the ones the winner was verified on (another eps, another
    size; another model's module in the same process) keeps its original forward, and so does a
    call the winner refuses (NotImplementedError for an argument's value it was not verified
    on), with one warning; the verified instance runs the winner."""
    from tools.fingerprint import instance_fingerprint
    seen = _Norm(4, 1e-5)
    winner = Winner("Norm", "_Norm", "c" * 16, TUNED_NORM, verified=[instance_fingerprint(seen)])
    text, _, skipped = kernels_module_text([winner], "r1", "model.py", None)
    assert not skipped
    path = tmp_path / "merged_norm.py"
    path.write_text(text)
    merged = _load(path)
    assert merged._nightshift_fingerprint(seen) == instance_fingerprint(seen)  # the one copied in is the same
    original = _Norm.forward
    try:
        assert merged.install({"_Norm": _Norm}) == ["_Norm"]
        x = torch.ones(2, 4)
        with torch.no_grad():
            assert float(_Norm(4, 1e-5).eval()(x)[0, 0]) > 1000  # alike: the winner
            assert float(_Norm(4, 0.5).eval()(x)[0, 0]) == 1.5  # another eps: the original
            assert float(_Norm(8, 1e-5).eval()(torch.ones(2, 8))[0, 0]) < 1000  # another size: the original
            with pytest.warns(UserWarning, match="refused a call it was not verified on"):
                out = _Norm(4, 1e-5).eval()(x, mask=torch.ones(2, 4))
            assert float(out[0, 0]) < 1000
            # Under torch.compile the winner is an opaque op recorded on a call without a mask; a
            # call with one runs the original compiled with the rest, never the op (whose winner
            # would refuse it and run the original eagerly, unfused).
            norm = _Norm(4, 1e-5).eval()
            compiled = merged.compile_model(norm, x, mask=None)
            ran = []
            for op in merged._nightshift_OPS.values():
                op.tuned = (lambda tuned: lambda *a, **k: ran.append(k.get("mask") is None) or tuned(*a, **k))(op.tuned)
            assert float(compiled(x, mask=None)[0, 0]) > 1000
            assert float(compiled(x, mask=torch.ones(2, 4))[0, 0]) < 1000
            assert ran == [True], ran
        # Autograd on, in eval mode (attribution, a forgotten no_grad): the kernels have no backward,
        # so the original runs and the gradients are the original's.
        norm = _Norm(4, 1e-5).eval()
        with pytest.warns(UserWarning, match="autograd on"):
            y = norm(x)
        assert float(y[0, 0]) < 1000 and y.requires_grad
        y.sum().backward()
        assert norm.weight.grad is not None
    finally:
        _Norm.forward = original


def test_under_compile_a_region_runs_its_own_code_where_the_compiler_was_as_fast(tmp_path):
    """integration.json's `under_compile`: shapes where torch.compile of the region was as fast as
    its winner. compile_model runs the region's own code there (compiled with the rest), as the
    measured "nightshift + <mode>" ways did; eager calls and other shapes keep the winner."""
    from agent.review.dispatch import shape_key
    x, wide = torch.ones(2, 4), torch.ones(3, 4)
    for shapes, compiled_runs_ours in (([shape_key((x,), {"mask": None})], {(2, 4): False, (3, 4): True}),
                                       (["*"], {(2, 4): False, (3, 4): False})):
        winner = Winner("Norm", "_Norm", "c" * 16, TUNED_NORM, under_compile=shapes)
        text, _, _ = kernels_module_text([winner], "r1", "model.py", None)
        path = tmp_path / f"merged_under_{len(shapes[0])}.py"
        path.write_text(text)
        merged = _load(path)
        original = _Norm.forward
        try:
            merged.install({"_Norm": _Norm})
            norm = _Norm(4, 1e-5).eval()
            with torch.no_grad():
                assert float(norm(x)[0, 0]) > 1000  # eager: the winner on every shape
                compiled = merged.compile_model(norm, wide, mask=None)
                for inp in (x, wide):
                    got = float(compiled(inp, mask=None)[0, 0]) > 1000
                    assert got == compiled_runs_ours[tuple(inp.shape)], (shapes, tuple(inp.shape))
        finally:
            _Norm.forward = original
            torch._dynamo.reset()


def test_block_loads_by_path_before_a_main_guard(tmp_path):
    """A KernelBench-style file name (starts with a digit: no `import` statement could name it),
    a trailing `if __name__ == "__main__":` and no newline at the end of the file."""
    from agent.apply import patched_lines, unified_patch
    model = tmp_path / "1_Square_matmul.py"
    original = "import sys\n\nclass Model:\n    pass\n\n\n# run it\nif __name__ == '__main__':\n    print(ROUTED)"
    model.write_text(original)
    (tmp_path / "1_Square_matmul_nightshift.py").write_text(
        "def install(namespace):\n    namespace['ROUTED'] = 'routed'\n    return ['Model']\n")
    old, new = patched_lines(original, "1_Square_matmul_nightshift.py", "r1", model)
    patch = unified_patch(old, new, model.name)
    assert "\\ No newline at end of file" in patch
    (tmp_path / "p.patch").write_text(patch)
    result = git(tmp_path, "apply", "p.patch")
    assert result.returncode == 0, result.stderr
    text = model.read_text()
    assert text.index("_nightshift_install(globals())") < text.index("# run it") and text.endswith("print(ROUTED)")
    ran = subprocess.run([sys.executable, model.name], cwd=tmp_path, capture_output=True, text=True)
    assert ran.returncode == 0 and ran.stdout == "routed\n", ran.stderr
    # Imported by path under another module name, from another working directory.
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('other_name', sys.argv[1]); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); print(m.ROUTED)")
    ran = subprocess.run([sys.executable, "-c", code, str(model)], cwd=ROOT, capture_output=True, text=True)
    assert ran.returncode == 0 and ran.stdout == "routed\n", ran.stderr
    # The block is found again: nothing more to patch.
    assert unified_patch(*patched_lines(text, "1_Square_matmul_nightshift.py", "r1", model), model.name) == ""
