"""The Ray executor on a real local Ray cluster of simulated nodes (CPU only).

Ray's own test utility (`ray.cluster_utils.Cluster`) starts a head node and two worker nodes
in this machine: node A carries the custom resource `gen:a: 2` (two worker actors of the
simulated generation `a`), node B `gen:b: 2`, and B's processes see one environment variable
that A's do not, so a candidate can behave differently on one generation. The tests that need
Ray skip without it (`pip install 'nightshift[ray]'`); the CLI checks below run everywhere.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agent.search.budget import Budget
from agent.executors.ray import PoolSlot, discover
from agent.history import load_history
from agent.search.loop import tune
from tools.problem import StopRule
from tools.runfolder import RunFolder
from tools.trial import Candidate, Status, Trial
from test_loop import FAST_WRONG, LIMITS, REGION, RIGHT, SLOW, TINY, StubPlanner

ROOT = Path(__file__).resolve().parent.parent
SIM_VAR = "TRITON_NIGHTSHIFT_SIMULATED_GEN"  # TRITON_* reaches sandbox workers (see sandbox/isolation.py)
SLOW0 = SLOW.replace("{i}", "0")
# Right on generation a, and off by 1e-3 (ten times the tolerance) where the node says `b`.
WRONG_ON_B = f"""import os, torch
def forward(module, x):
    xf = x.float()
    y = module.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.eps)).to(x.dtype)
    return y + (1e-3 if os.environ.get("{SIM_VAR}") == "b" else 0.0)
"""


def h(source: str) -> str:
    return Candidate(region=REGION, source=source).hash


# -- pure parts, no Ray needed -------------------------------------------------------------------
def test_discover_reads_gen_resources_and_gpu_accelerator_types():
    nodes = [
        {"NodeID": "head", "Alive": True, "Resources": {"CPU": 8.0}},  # no workers on a plain head
        {"NodeID": "h200", "Alive": True, "Resources": {"CPU": 64.0, "GPU": 8.0, "accelerator_type:H200": 1.0}},
        {"NodeID": "mi300", "Alive": True, "Resources": {"GPU": 4.0, "gen:MI300X": 4.0}},
        {"NodeID": "sim", "Alive": True, "Resources": {"CPU": 1.0, "gen:a": 2.0}},
        {"NodeID": "gone", "Alive": False, "Resources": {"gen:a": 5.0}},
    ]
    pools = discover(nodes)
    assert sorted(pools) == ["H200", "MI300X", "a"]
    assert pools["H200"] == [PoolSlot("H200", "h200", 8, True, "accelerator_type:H200", 0.001, workers=4)]
    assert pools["MI300X"] == [PoolSlot("MI300X", "mi300", 4, True, "gen:MI300X", 1.0, workers=2)]
    assert pools["a"] == [PoolSlot("a", "sim", 2, False, "gen:a", 1.0, workers=1)]


def _agent(*args, prelude: str = "pass") -> subprocess.CompletedProcess:
    code = f"import sys; {prelude}; from agent.cli.main import app; sys.argv = ['agent'] + sys.argv[1:]; app()"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)


@pytest.mark.parametrize("args, prelude, words", [
    (["--executor", "slurm"], "pass", "--executor 'slurm': use local or ray"),
    (["--executor", "ray"], "sys.modules['ray'] = None", "pip install 'nightshift[ray]'"),
    (["--ray-address", "10.0.0.1:6379"], "pass", "--ray-address needs --executor ray"),
])
def test_executor_choice_errors_exit_2_before_profiling(args, prelude, words, tmp_path):
    result = _agent("tune", "--model", TINY, "--runs-dir", tmp_path / "runs", *args, prelude=prelude)
    assert result.returncode == 2, result.stderr[-2000:]
    assert words in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()  # nothing profiled


# -- on a Ray cluster ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from agent.executors.ray import connect
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        nodes = {"a": cluster.add_node(num_cpus=1, resources={"gen:a": 2}),
                 "b": cluster.add_node(num_cpus=1, resources={"gen:b": 2}, env_vars={SIM_VAR: "b"})}
        assert connect(cluster.address)
        yield {g: n.node_id for g, n in nodes.items()}
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def frozen(tmp_path_factory) -> Path:
    from agent.setup.jobs import profile_and_freeze
    res = profile_and_freeze(TINY, "cpu", None, tmp_path_factory.mktemp("ray-runs"))
    return res.run.path


@pytest.fixture
def run(frozen, tmp_path) -> RunFolder:
    shutil.copytree(frozen, tmp_path / "run")
    return RunFolder(tmp_path / "run")


@pytest.fixture(scope="module")
def executor(ray_cluster, frozen):
    """Four long-lived worker actors (two per generation), shared by the tests below."""
    from agent.executors.ray import RayExecutor
    ex = RayExecutor([p for p in (frozen / "problems").iterdir()], limits=LIMITS, memory_gb=4)
    try:
        yield ex
    finally:
        ex.close()


def loop(run: RunFolder, executor, planner, rule: StopRule, should_stop=lambda: False, on_trial=lambda t: None):
    problems = run.problems()
    history = load_history(run, problems, executor.generations)
    store = run.store()
    budget = Budget(rule, spent_seconds=store.gpu_seconds(), candidates_tried=len(history.records))
    store.close()
    outcome = tune(run, problems, planner, executor, budget, history, on_trial, should_stop)
    return outcome, budget, load_history(run, problems, executor.generations)


def stored(run: RunFolder) -> list[Trial]:
    store = run.store(readonly=True)
    try:
        return list(store.trials())
    finally:
        store.close()


def by_candidate(trials: list[Trial]) -> dict[str, list[Trial]]:
    out: dict[str, list[Trial]] = {}
    for t in trials:
        out.setdefault(t.candidate_hash, []).append(t)
    return out


def test_one_actor_per_device_in_pools_per_generation(executor, ray_cluster):
    assert executor.generations == ["a", "b"]
    live = [a for a in executor.actors if a.alive]
    assert sorted((a.generation, a.node_id) for a in live) == sorted(
        [("a", ray_cluster["a"])] * 2 + [("b", ray_cluster["b"])] * 2)
    assert len(executor.runners) == 4  # one sandbox worker per CPU actor: the loop's batch size
    assert executor.describe() == "Ray: a 2 devices on 1 node, b 2 devices on 1 node"


def test_every_candidate_runs_on_every_generation_and_is_kept_only_if_right_on_all(run, executor, ray_cluster):
    planner = StubPlanner([FAST_WRONG, RIGHT, SLOW0, WRONG_ON_B])
    outcome, budget, history = loop(run, executor, planner, StopRule(max_candidates=10, patience=10))
    trials = stored(run)
    assert outcome.stop_reason == "planners have nothing new to try"
    assert len(trials) == 8 == outcome.trials_run
    runs_on = {d: {t.generation for t in ts} for d, ts in by_candidate(trials).items()}
    assert runs_on == {h(s): {"a", "b"} for s in (FAST_WRONG, RIGHT, SLOW0, WRONG_ON_B)}
    for t in trials:  # each trial ran on a node of its generation, and says so
        assert t.device.startswith("cpu@" + ray_cluster[t.generation][:8]), t.device
    odd = {t.generation: t for t in by_candidate(trials)[h(WRONG_ON_B)]}
    assert odd["a"].status is Status.ok and odd["b"].status is Status.wrong
    # The cross-generation keep rule: a pass on a and a failure on b is not kept.
    assert {r.candidate_hash for r in history.kept(REGION)} == {h(RIGHT), h(SLOW0)}
    assert budget.spent == pytest.approx(sum(t.gpu_seconds for t in trials))
    assert all(t.gpu_seconds > 0 for t in trials)


def test_a_worker_actor_killed_mid_trial_costs_that_trial_only(run, executor, tmp_path):
    import ray
    # Slow to import (every attempt: a jailed candidate leaves no trace between workers): the
    # first actor seen running it for a second is killed; the retry elsewhere takes 3 s and passes.
    slow_once = f"""import time, torch
time.sleep(3)
def forward(module, x):
    xf = x.float()
    return module.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.eps)).to(x.dtype)
"""
    killed: dict = {}

    def kill_when_it_sleeps():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for actor in [a for a in executor.actors if a.alive]:
                try:
                    running = ray.get(actor.handle.running.remote(), timeout=5)
                except Exception:
                    continue
                if running.get(h(slow_once), 0.0) >= 1.0:
                    killed["actor"] = actor
                    ray.kill(actor.handle, no_restart=True)
                    return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_when_it_sleeps, daemon=True)
    killer.start()
    outcome, budget, history = loop(run, executor, StubPlanner([slow_once, RIGHT]),
                                    StopRule(max_candidates=10, patience=10))
    killer.join(5)
    victim = killed["actor"]
    trials = stored(run)
    slow = by_candidate(trials)[h(slow_once)]
    lost = [t for t in slow if t.status is Status.lost]
    assert len(lost) == 1 and lost[0].generation == victim.generation and lost[0].device == victim.label
    assert "lost mid-trial" in lost[0].reason and lost[0].gpu_seconds > 0  # its device time is charged
    again = [t for t in slow if t.generation == victim.generation and t.status is not Status.lost]
    assert len(again) == 1 and again[0].status is Status.ok and again[0].device != victim.label
    assert {t.generation for t in slow if t.status is Status.ok} == {"a", "b"}
    # The run went on: the other candidate ran everywhere, and the retried one is kept.
    assert {t.generation for t in by_candidate(trials)[h(RIGHT)]} == {"a", "b"}
    assert outcome.stop_reason == "planners have nothing new to try"
    assert {r.candidate_hash for r in history.kept(REGION)} == {h(slow_once), h(RIGHT)}
    assert budget.spent == pytest.approx(sum(t.gpu_seconds for t in trials))
    assert not victim.alive and len([a for a in executor.actors if a.alive]) == 3

    # The next round tops the pool up again: the node is still there, so its device is too.
    loop(run, executor, StubPlanner([SLOW0]), StopRule(max_candidates=10, patience=10))
    live = [a for a in executor.actors if a.alive]
    assert sorted(a.generation for a in live) == ["a", "a", "b", "b"]


def test_resume_after_a_stop_redoes_nothing(run, executor):
    variants = [RIGHT.replace("import torch", f"import torch  # {i}") for i in range(5)]
    rule = StopRule(max_candidates=10, patience=100)
    stop, seen = threading.Event(), []

    def on_trial(t):
        seen.append(t)
        if len(seen) >= 3:
            stop.set()

    first, _, _ = loop(run, executor, StubPlanner(variants), rule, stop.is_set, on_trial)
    assert first.trials_run >= 3
    before = stored(run)
    assert len(before) == first.trials_run < 10

    second, _, history = loop(run, executor, StubPlanner(variants), rule)
    after = stored(run)
    keys = [(t.region, t.candidate_hash, t.generation) for t in after]
    assert len(keys) == len(set(keys)), "a finished (candidate, generation) was run again"
    assert [t.model_dump() for t in after[: len(before)]] == [t.model_dump() for t in before]
    assert second.trials_run == len(after) - len(before)
    assert second.stop_reason == "planners have nothing new to try"
    assert {t.candidate_hash for t in after} == {h(v) for v in variants}
    assert all(set(ts_gen) == {"a", "b"} for ts_gen in
               ({t.generation for t in ts} for ts in by_candidate(after).values()))
    failed = [(t.generation, t.status.value, t.reason[:200]) for t in after if t.status is not Status.ok]
    assert len(history.kept(REGION)) == 5, failed


def test_a_target_generation_missing_from_the_cluster_is_an_error_before_the_first_trial(run, ray_cluster):
    from agent.executors.ray import ClusterError, RayExecutor
    from agent.search.tuning import UserError, run_tune
    with pytest.raises(ClusterError, match="no worker of target generation c "):
        RayExecutor([run.problems_dir / REGION], targets=["a", "c"], limits=LIMITS)

    from tools import seal
    meta = json.loads((run.problems_dir / REGION / "problem.json").read_text())
    meta["target_generations"] = ["a", "H200"]
    (run.problems_dir / REGION / "problem.json").write_text(json.dumps(meta))
    seal.record(run.path, [run.problems_dir / REGION / "problem.json"])  # frozen again, as profile would
    with pytest.raises(UserError, match="H200") as info:
        run_tune(run, "template", None, StopRule(max_candidates=3), executor_name="ray")
    assert "cluster generations: a, b" in str(info.value) and "\n" not in str(info.value)
    assert not (run.path / "trials.sqlite").exists() or stored(run) == []  # not one trial ran
