"""A compile baseline's caches carried to the ways with our kernels in its mode
(agent/review/compile_caches.py): the baseline's worker writes its mode's folder, a composed way's
worker starts from a copy (run again, from its own earlier copy), and nothing a composed way
(candidate code) writes reaches the baseline's folder; no other worker sees either."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# A correct RMSNorm (the module's own forward) that leaves a mark in the cache it compiles into,
# and fails when the mark it expects is not there: each way's verdict says what its worker saw.
MARKS = '''import os


def forward(module, x):
    cache = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    for name in {expect!r}:
        if not os.path.exists(os.path.join(cache, name)):
            raise RuntimeError(f"{{name}} is not in the cache this worker started from")
    for name in {forbid!r}:
        if os.path.exists(name):
            raise RuntimeError(f"{{name}} is visible to this worker")
    os.makedirs(cache, exist_ok=True)  # a worker's own is made on its first compile
    with open(os.path.join(cache, {write!r}), "w") as f:
        f.write({write!r})
    return module(x)
'''


def _marks(expect=(), forbid=(), write="mark"):
    from tools.trial import Candidate
    return Candidate(region="RMSNorm", planner="manual",
                     source=MARKS.format(expect=list(expect), forbid=list(forbid), write=write))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from agent.setup.jobs import profile_and_freeze
    tmp = tmp_path_factory.mktemp("compile_caches")
    return profile_and_freeze(ROOT / "tests" / "models" / "tiny_rmsnorm.py", "cpu", None, tmp / "runs").run


def test_a_composed_way_starts_from_a_copy_of_its_modes_baseline_and_never_writes_it(run):
    from agent.review.compile_caches import CompileCaches
    from agent.review.ways import side_by_side
    from sandbox.pool import DevicePool
    caches = CompileCaches(run.path)
    pool = DevicePool("cpu", [run.problems_dir / "RMSNorm"], cpu_lock=True)
    steps: list[str] = []
    try:
        first = side_by_side(pool, [("torch.compile", _marks(write="baseline")),
                                    ("tuned", _marks(forbid=[str(caches.root)], write="tuned"))], steps.append,
                             caches=caches)
        assert {n: t.status.value for n, t in first.items()} == {"torch.compile": "ok", "tuned": "ok"}, steps
        baseline = caches.root / "torch.compile"
        assert (baseline / "baseline").read_text() == "baseline"
        assert not (baseline / "tuned").exists()  # a way with no cache of its own compiled elsewhere
        # The composed way sees the baseline's mark in its copy, also by the baseline's absolute
        # path (Triton's group files name their kernel's files so); what it writes lands in the copy only.
        later = side_by_side(pool, [("nightshift + torch.compile", _marks(expect=["baseline", str(baseline / "baseline")],
                                                                          write="composed")),
                                    ("nightshift + reduce-overhead", _marks(forbid=[str(baseline)], write="other"))],
                             steps.append, caches=caches)
        assert {n: t.status.value for n, t in later.items()} == {"nightshift + torch.compile": "ok",
                                                                 "nightshift + reduce-overhead": "ok"}, steps
        assert sorted(os.listdir(baseline)) == ["baseline"] and (baseline / "baseline").read_text() == "baseline"
        assert pool.runners[0].config.compile_cache is None  # the kept runner's next worker has none
        # Run again (a reroute), the composed way starts from what it compiled the first time.
        first_copy = caches.copies["nightshift + torch.compile"]
        again = side_by_side(pool, [("nightshift + torch.compile", _marks(expect=["baseline", "composed"],
                                                                          write="again"))], steps.append, caches=caches)
        assert again["nightshift + torch.compile"].status.value == "ok", steps
        assert "nightshift + torch.compile compiles from a copy of the torch.compile baseline's cache (0 MB)" in steps
        assert "nightshift + torch.compile compiles from a copy of its own first compile's cache (0 MB)" in steps
        assert sorted(os.listdir(baseline)) == ["baseline"] and not Path(first_copy).exists()
    finally:
        pool.close()
        caches.drop_copies()
    assert caches.copies == {}


def test_what_a_baseline_way_is_given_and_what_else_gets_nothing(tmp_path):
    from agent.review.compile_caches import CompileCaches
    caches = CompileCaches(tmp_path)
    own, seen_at = map(Path, caches.folder("max-autotune-no-cudagraphs"))
    assert own == seen_at == tmp_path / "compile_cache" / "max-autotune-no-cudagraphs"
    assert own.stat().st_mode & 0o777 == 0o777 and caches.root.stat().st_mode & 0o777 == 0o700
    (own / "sub").mkdir()
    (own / "sub" / "kernel.so").write_bytes(b"x")
    copy, seen_at = map(Path, caches.folder("nightshift + max-autotune-no-cudagraphs"))
    assert (copy / "sub" / "kernel.so").read_bytes() == b"x" and not copy.is_relative_to(tmp_path)
    assert seen_at == own  # the jail shows the copy where the baseline's files say they are
    assert (copy / "sub").stat().st_mode & 0o777 == 0o777  # a worker run as nobody writes there too
    assert Path(caches.folder("nightshift + reduce-overhead")[0]).is_dir()  # no baseline yet: an empty one
    assert caches.folder("tuned") is None and caches.folder("graphed") is None
    caches.drop_copies()
    assert not copy.exists() and own.is_dir()  # the baseline's stays: integrating again compiles from it


def test_a_composed_way_where_the_compilers_code_runs_hits_its_baselines_graph_cache(tmp_path, monkeypatch):
    """What a composed way's copy of the baseline's cache is for: where only the compiler's code
    runs, its graphs are the baseline's and Inductor takes them from the cache instead of compiling
    (on the H100, 2026-12-06, ns + max-autotune-no-cudagraphs still compiled 141 s from its copy:
    the probe's counters now say which). Run in this process, the cache folder the test's own."""
    import importlib.util

    import torch
    from torch import nn

    from agent.review.ways import composed_candidate
    from sandbox import compiled
    from tools.problem import Problem

    class Blk(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.linspace(0.5, 2.0, 64))

        def forward(self, x):
            return torch.relu(x * self.w).sin() + 1

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Blk(), Blk()

        def forward(self, x):
            return self.b(self.a(x).cos()) * 2

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    net, x = Net().eval(), torch.randn(32, 64)
    winner = ("def forward(module, x):\n    return type(module).forward(module, x)\n\n\n"
              "def runs_kernel(args, kwargs):\n    return False  # as torch.compile of a region: the compiler's code\n")
    path = tmp_path / "way.py"
    path.write_text(composed_candidate([(Problem.model_construct(name="Blk", region_class="Blk"), winner)], None).source)
    spec = importlib.util.spec_from_file_location("composed_way", path)
    way = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(way)
    with torch.no_grad():
        torch._dynamo.reset()
        before = compiled.counters()
        want = torch.compile(net)(x)
        baseline = {k: v - before[k] for k, v in compiled.counters().items()}
        torch._dynamo.reset()
        before = compiled.counters()
        for _ in range(2):  # its first call records, eagerly; the next is compiled
            got = way.forward(net, x)
        composed = {k: v - before[k] for k, v in compiled.counters().items()}
    torch.testing.assert_close(got, want)
    assert baseline["fx_cache_misses"] >= 1 and baseline["fx_cache_hits"] == 0, baseline
    assert composed["fx_cache_hits"] >= 1 and composed["fx_cache_misses"] == 0, composed
