"""The search loop on the CPU: what is kept, when it stops, resume after kill -9, and the
keep-only-if-it-holds-on-every-generation rule.

Most tests use `tests/models/tiny_rmsnorm.py` (one RMSNorm region, 8x64 inputs) and pure
torch stub candidates, so a trial costs a fraction of a second once the worker is up.
"""

import hashlib
import json
import math
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agent.search.budget import Budget
from agent.executors.local import LocalExecutor, parse_devices
from agent.history import History
from agent.history import load_history
from agent.search.loop import tune
from agent.planners.library import applicable
from agent.planners.template import TemplatePlanner
from sandbox.runner import Limits
from tools.problem import StopRule
from tools.runfolder import RunFolder
from tools.trial import Candidate, Status, Trial

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "models" / "tiny_rmsnorm.py"
REGION = "RMSNorm"
LIMITS = Limits(compile_s=60, run_s=30, time_s=60, budget_ms=50, max_reps=20)

RIGHT = """import torch
def forward(module, x):
    xf = x.float()
    return module.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.eps)).to(x.dtype)
"""
# Correct but doing the work twenty times: always slower than the original, equally so.
SLOW = """import torch
def forward(module, x):
    # variant {i}
    for _ in range(20):
        xf = x.float()
        y = module.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.eps)).to(x.dtype)
    return y
"""
FAST_WRONG = """def forward(module, x):
    return x * module.weight
"""
# Right function plus 1e-3: ten times the abs 1e-4 tolerance, and just as fast as RIGHT.
JUST_OUTSIDE = RIGHT.replace("return module.weight", "return 1e-3 + module.weight")
NAN = """import torch
def forward(module, x):
    return torch.full_like(x, float("nan"))
"""


class StubPlanner:
    """Proposes fixed sources in order, up to n at a time; `forever` adds numbered variants."""

    name = "stub"

    def __init__(self, sources=(), forever: str | None = None):
        self.sources = list(sources)
        self.forever = forever
        self.count = 0

    def propose(self, problem, history, n):
        out = [Candidate(region=problem.name, source=s, planner=self.name) for s in self.sources]
        out = [c for c in out if not history.tried(problem.name, c.hash)]
        while self.forever and len(out) < n:
            self.count += 1
            out.append(Candidate(region=problem.name, source=self.forever.replace("{i}", str(self.count)),
                                 planner=self.name))
        return out[:n]


def h(source: str) -> str:
    return Candidate(region=REGION, source=source).hash


@pytest.fixture(scope="module")
def frozen_tiny(tmp_path_factory):
    """A run folder of the tiny model, profiled and frozen once; tests get copies."""
    from agent.setup.jobs import profile_and_freeze
    res = profile_and_freeze(TINY, "cpu", None, tmp_path_factory.mktemp("tiny-runs"))
    assert [p.name for p in res.problems] == [REGION]
    return res.run.path


@pytest.fixture
def run(frozen_tiny, tmp_path) -> RunFolder:
    dst = tmp_path / "run"
    shutil.copytree(frozen_tiny, dst)
    return RunFolder(dst)


def run_loop(run: RunFolder, planner, rule: StopRule, devices: str = "cpu", budget: Budget | None = None):
    problems = run.problems()
    slots, _ = parse_devices(devices)
    executor = LocalExecutor(slots, [run.problems_dir / p.name for p in problems], LIMITS, memory_gb=4)
    try:
        history = load_history(run, problems, executor.generations)
        budget = budget or Budget(rule)
        outcome = tune(run, problems, planner, executor, budget, history)
    finally:
        executor.close()
    return outcome, budget, load_history(run, problems, executor.generations)


def stored(run: RunFolder) -> list[Trial]:
    store = run.store(readonly=True)
    try:
        return list(store.trials())
    finally:
        store.close()


# -- what is kept ----------------------------------------------------------------------------
def test_template_planner_finds_and_keeps_a_correct_rmsnorm(run):
    problem = run.problems()[0]
    assert "rmsnorm" in {t.name for t, _ in applicable(problem)}
    outcome, _, history = run_loop(run, TemplatePlanner(), StopRule(max_candidates=3, patience=50))

    assert outcome.stop_reason.startswith("candidate cap")
    kept = history.kept(REGION)
    assert kept, [(t.template, t.status, t.reason) for t in history.trials]
    assert all(t.status is Status.ok and t.speedup for r in kept for t in r.by_generation.values())
    assert {r.template for r in kept} == {"rmsnorm"}
    assert outcome.best[REGION] == pytest.approx(kept[0].score(["cpu"]))
    # The LayerNorm template fits the shapes too; the tolerance, not its name, throws it out.
    layernorm = [t for t in history.trials if t.template == "layernorm"]
    assert layernorm and all(t.status is Status.wrong and not t.ranked for t in layernorm)
    for t in history.trials:  # every candidate's source is kept in the run for review
        path = Path(t.candidate_path)
        assert path.parent == run.candidates_dir and h(path.read_text()) == t.candidate_hash


def test_out_of_tolerance_candidates_are_never_kept_or_ranked(run):
    from agent import report
    planner = StubPlanner([FAST_WRONG, JUST_OUTSIDE, NAN, SLOW.replace("{i}", "0"), RIGHT])
    outcome, _, history = run_loop(run, planner, StopRule(max_candidates=10, patience=10))

    assert outcome.stop_reason == "planners have nothing new to try"
    status = {t.candidate_hash: t for t in stored(run)}
    assert status[h(FAST_WRONG)].status is Status.wrong
    assert status[h(NAN)].status is Status.nan
    outside = status[h(JUST_OUTSIDE)]
    assert outside.status is Status.wrong and outside.error == pytest.approx(1e-3, rel=0.01)
    for digest in (h(FAST_WRONG), h(JUST_OUTSIDE), h(NAN)):  # rejected before timing: no speed at all
        assert not status[digest].ranked and status[digest].speedup is None and not status[digest].timings

    kept = [r.candidate_hash for r in history.kept(REGION)]
    assert kept == [h(RIGHT), h(SLOW.replace("{i}", "0"))], [(t.status, t.reason) for t in stored(run)]  # ranked by speed, the inaccurate nowhere
    assert history.best(REGION).candidate_hash == h(RIGHT)

    text = report.write(run).read_text()
    row = next(line for line in text.splitlines() if line.startswith(f"| {REGION} |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # A CPU run's table names the best candidate, never a CPU speedup (correctness only).
    assert cells[2:5] == ["5", "2", history.best(REGION).candidate_hash]
    assert "nan 1, wrong 2" in text
    rejected = [line for line in text.splitlines() if line.strip().startswith("- `")]
    assert {line.split("`")[1] for line in rejected} == {h(FAST_WRONG), h(JUST_OUTSIDE), h(NAN)}


# -- stop rules ------------------------------------------------------------------------------
def test_candidate_cap_tries_exactly_that_many(run):
    outcome, budget, _ = run_loop(run, StubPlanner(forever=RIGHT.replace("import torch", "import torch  # {i}")),
                                  StopRule(max_candidates=3, patience=100))
    trials = stored(run)
    assert outcome.stop_reason == "candidate cap: 3 candidates tried"
    assert len({t.candidate_hash for t in trials}) == 3 == len(trials) == outcome.trials_run
    assert budget.tried == 3


def test_patience_ends_a_search_that_stops_improving(run):
    patience = 3
    outcome, budget, history = run_loop(run, StubPlanner(forever=SLOW), StopRule(max_candidates=50, patience=patience))
    trials = stored(run)
    assert outcome.stop_reason.startswith("patience")
    assert all(t.status is Status.ok and t.speedup < 1.0 for t in trials)
    # One batch may be in flight when patience runs out; the cap is nowhere near.
    assert patience <= len(trials) < patience + 4 < 50
    assert not budget.region_open(REGION)


def test_gpu_hours_cap_below_one_trial_starts_nothing(run):
    outcome, budget, _ = run_loop(run, StubPlanner([RIGHT]), StopRule(gpu_hours=0.001))
    assert outcome.stop_reason.startswith("device-hours cap")
    assert stored(run) == [] and budget.spent == 0.0


def test_gpu_hours_cap_stops_the_run_within_one_trial_of_the_cap(run):
    rule = StopRule(gpu_hours=5.0 / 3600, max_candidates=1000, patience=1000)
    budget = Budget(rule)
    # A budget that has already seen one 0.5 s trial (as a run does after its first trials),
    # so the first launch is estimated at 0.5 s instead of the cautious default.
    budget.finish(-1, Trial(region=REGION, candidate_hash="seen", status=Status.ok, gpu_seconds=0.5))
    outcome, budget, _ = run_loop(run, StubPlanner(forever=RIGHT.replace("import torch", "import torch  # {i}")),
                                  rule, budget=budget)
    trials = stored(run)
    assert outcome.stop_reason.startswith("device-hours cap")
    assert 1 <= len(trials) < 100
    assert budget.spent == pytest.approx(0.5 + sum(t.gpu_seconds for t in trials))
    assert budget.spent <= budget.cap_seconds + max(t.gpu_seconds for t in trials)


def test_parallel_launches_share_the_cap_instead_of_enlarging_it():
    budget = Budget(StopRule(gpu_hours=31 / 3600))
    assert budget.try_launch(0, "cuda:0", REGION)
    budget.finish(0, Trial(region=REGION, candidate_hash="a", status=Status.ok, gpu_seconds=3.0,
                           finished_at=time.time()))
    # One trial at a time on each of 20 devices: 3 s spent + 9 devices * 3 s = 30 s; a tenth would pass 31 s.
    launched = [t for t in range(1, 20) if budget.try_launch(t, f"cuda:{t}", REGION)]
    assert launched == list(range(1, 10))
    assert not budget.exhausted and not budget.stop_reason  # trials in flight may still make room
    budget.cancel(1)  # an interrupted launch gives its reservation back
    assert budget.try_launch(20, "cuda:20", REGION) and not budget.try_launch(21, "cuda:21", REGION)
    for t in [*range(2, 10), 20]:
        budget.cancel(t)
    budget.spent = 28.5
    assert not budget.try_launch(22, "cuda:0", REGION)  # nothing in flight and it does not fit: the end
    assert budget.exhausted and budget.stop_reason.startswith("device-hours cap")


def test_workers_sharing_one_device_take_turns_so_their_reservations_add_up():
    """Six workers on one GPU compile side by side but verify and time in turn, each charged what
    it added to the device's wall time: together they cost six trials' charges, not one."""
    budget = Budget(StopRule(gpu_hours=20 / 3600))
    budget.finish(-1, Trial(region=REGION, candidate_hash="seen", status=Status.ok, gpu_seconds=3.0,
                            phases={"wall": 9.0, "start": 1.0}, finished_at=time.time()))
    assert budget.estimate(REGION) == 2.0  # its charge, less the worker's one-time start
    assert [budget.try_launch(t, "cuda:0", REGION) for t in range(9)] == [True] * 8 + [False]
    assert budget.projected() == pytest.approx(3.0 + 8 * 2.0)
    assert not budget.exhausted


def test_a_small_cap_runs_one_first_trial_before_anything_is_measured():
    """The H200 run of issue 26: a 0.04 h cap, six lanes, first trials of 93 s each. Six launched
    at once against a 20 s guess overran the cap by 79%; now the first trial runs alone, and what
    it cost decides whether a second one fits."""
    budget = Budget(StopRule(gpu_hours=0.04))
    assert budget.try_launch(0, "cuda:0", REGION)
    assert not any(budget.try_launch(t, "cuda:0", REGION) for t in range(1, 6))  # a cold trial each: 2 x 120 s > 144 s
    assert not budget.exhausted  # they wait for the first
    budget.finish(0, Trial(region=REGION, candidate_hash="a", status=Status.ok, gpu_seconds=93.0,
                           phases={"start": 7.0}, finished_at=time.time()))
    assert budget.estimate(REGION) == 86.0
    assert not budget.try_launch(1, "cuda:0", REGION)  # 93 s + 86 s > 144 s: never started
    assert budget.exhausted and budget.spent <= budget.cap_seconds
    assert Budget(StopRule(gpu_hours=0.001)).try_launch(0, "cuda:0", REGION) is False  # below any trial


def test_the_region_a_lane_takes_is_the_one_its_launch_is_estimated_by():
    budget = Budget(StopRule(gpu_hours=1.0))
    budget.finish(-1, Trial(region="cheap", candidate_hash="a", status=Status.ok, gpu_seconds=1.0))
    budget.finish(-1, Trial(region="dear", candidate_hash="b", status=Status.ok, gpu_seconds=50.0))
    budget.taking("cheap")
    assert budget.try_launch(0, "cuda:0") and budget.in_flight[0].seconds == 1.0
    budget.taking("dear")
    assert budget.try_launch(1, "cuda:0") and budget.in_flight[1].seconds == 50.0
    assert budget.estimate("new") == 120.0  # a region not measured yet: a cold trial


def test_a_refused_launch_fits_once_a_trial_in_flight_ends_sooner_than_reserved():
    budget = Budget(StopRule(gpu_hours=10 / 3600))
    budget.by_region[REGION].append(3.0)
    assert all(budget.try_launch(t, f"cuda:{t}", REGION) for t in range(3))  # 9 s reserved
    assert not budget.try_launch(3, "cuda:3", REGION)  # 12 s
    now = time.time()  # cuda:0's trial took 0.5 s, not the 3 s reserved
    budget.finish(0, Trial(region=REGION, candidate_hash="b", status=Status.ok, gpu_seconds=0.5,
                           phases={"wall": 0.5}, started_at=now - 0.5, finished_at=now))
    assert budget.try_launch(3, "cuda:3", REGION)  # 0.5 s spent + 2 * 3 s in flight + 3 s = 9.5 s


def test_planning_ahead_skips_candidates_queued_or_in_flight(run):
    """The planner is asked again while earlier candidates still wait or run: it must not
    re-propose them (that would run one twice or leave the queue short). There are no rounds
    any more, so what is checked is that each of the six ran once, on the planners' answers."""
    sources = [SLOW.replace("{i}", str(i)) for i in range(6)]
    outcome, _, history = run_loop(run, StubPlanner(sources), StopRule(max_candidates=100, patience=100))
    digests = [t.candidate_hash for t in stored(run)]
    assert sorted(digests) == sorted(h(s) for s in sources)
    assert outcome.plans >= 3 and outcome.stop_reason == "planners have nothing new to try"


class MidRoundBlind(StubPlanner):
    """Proposes nothing while an odd number of results is in: a planner that needs more results
    before it can say anything new."""

    def propose(self, problem, history, n):
        return [] if len(history.trials) % 2 else super().propose(problem, history, n)


def test_a_plan_with_nothing_new_is_asked_again_once_results_are_in(run):
    sources = [SLOW.replace("{i}", str(i)) for i in range(6)]
    outcome, _, history = run_loop(run, MidRoundBlind(sources), StopRule(max_candidates=100, patience=100))
    assert {h(s) for s in sources} <= {d for (_, d) in history.records}  # not stopped after the first round
    assert outcome.stop_reason == "planners have nothing new to try"


# -- resume ----------------------------------------------------------------------------------
def _problem_hashes(run: Path) -> dict[str, str]:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((run / "problems").rglob("*")) if p.is_file()}


def test_resume_after_kill_9_redoes_nothing(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "agent", "tune", "--devices", "cpu", "--max-candidates", "8", "--patience", "50",
           "--no-integrate", "--json"]
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(cmd + ["--model", str(TINY), "--runs-dir", str(runs)], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline, count = time.monotonic() + 120, 0
        while time.monotonic() < deadline and proc.poll() is None:
            dbs = list(runs.glob("*/trials.sqlite"))
            if dbs:
                store = RunFolder(dbs[0].parent).store(readonly=True)
                try:
                    count = store.count()
                except sqlite3.OperationalError:  # the file exists a moment before its tables
                    count = 0
                finally:
                    store.close()
                if count >= 2:
                    break
            time.sleep(0.05)
        assert proc.poll() is None, "the run finished before it could be killed:\n" + (tmp_path / "first.log").read_text()
        assert count >= 2
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL

    run = RunFolder(dbs[0].parent)
    before = stored(run)
    done_before = {(t.region, t.candidate_hash, t.generation) for t in before}
    problems_before = _problem_hashes(run.path)

    resumed = subprocess.run(cmd + ["--resume", str(run.path)], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout)

    after = stored(run)
    keys = [(t.region, t.candidate_hash, t.generation) for t in after]
    assert len(keys) == len(set(keys)), "a finished (region, candidate, generation) was run again"
    assert done_before <= set(keys)
    assert [t.model_dump() for t in after[: len(before)]] == [t.model_dump() for t in before]
    assert summary["trials"] == len(after) - len(before)
    assert len({t.candidate_hash for t in after}) <= 8  # the candidate cap holds across the kill
    assert _problem_hashes(run.path) == problems_before


# -- device generations ----------------------------------------------------------------------
def _trial(digest: str, generation: str, status: Status = Status.ok, speedup: float | None = 1.5) -> Trial:
    return Trial(region=REGION, candidate_hash=digest, status=status, generation=generation,
                 speedup=speedup if status is Status.ok else None)


def test_a_win_on_one_generation_and_a_failure_on_another_is_not_kept():
    history = History({REGION: ["a", "b"]})
    history.add(_trial("x", "a", speedup=3.0))
    history.add(_trial("x", "b", Status.wrong))
    history.add(_trial("only-a", "a", speedup=5.0))  # not yet run on b: not kept either
    assert history.kept(REGION) == [] and history.best(REGION) is None
    assert not history.tried(REGION, "only-a") and history.tried(REGION, "x")

    # Ranked by the worst generation: a regression on b outweighs a big win on a.
    history.add(_trial("uneven", "a", speedup=2.0))
    history.add(_trial("uneven", "b", speedup=0.8))
    history.add(_trial("steady", "a", speedup=1.2))
    history.add(_trial("steady", "b", speedup=1.1))
    assert [r.candidate_hash for r in history.kept(REGION)] == ["steady", "uneven"]
    assert history.best(REGION).score(["a", "b"]) == pytest.approx(1.1)


def test_parse_devices_simulates_generations_on_the_cpu():
    slots, notes = parse_devices("cpu@a, cpu@b")
    assert [(s.device, s.generation) for s in slots] == [("cpu", "a"), ("cpu", "b")] and notes == []
    with pytest.raises(ValueError, match="unknown device"):
        parse_devices("tpu")


def test_every_candidate_is_tried_on_every_generation(run):
    outcome, _, history = run_loop(run, StubPlanner([FAST_WRONG, RIGHT, SLOW.replace("{i}", "0")]),
                                   StopRule(max_candidates=10, patience=10), devices="cpu@a,cpu@b")
    trials = stored(run)
    assert history.targets(REGION) == ["a", "b"]
    by_candidate: dict[str, set[str]] = {}
    for t in trials:
        by_candidate.setdefault(t.candidate_hash, set()).add(t.generation)
    assert by_candidate == {h(FAST_WRONG): {"a", "b"}, h(RIGHT): {"a", "b"}, h(SLOW.replace("{i}", "0")): {"a", "b"}}
    assert len(trials) == 6 == outcome.trials_run
    kept = history.kept(REGION)
    assert {r.candidate_hash for r in kept} == {h(RIGHT), h(SLOW.replace("{i}", "0"))}
    assert all(set(r.speedups()) == {"a", "b"} for r in kept)


# -- budget validation -----------------------------------------------------------------------
@pytest.mark.parametrize("field, value, words", [
    ("gpu_hours", math.nan, "finite"), ("gpu_hours", math.inf, "finite"), ("gpu_hours", -1.0, "non-negative"),
    ("patience", -3, "non-negative"), ("max_candidates", -1, "non-negative"), ("max_usd", math.nan, "finite"),
])
def test_stop_rule_rejects_impossible_budgets(field, value, words):
    with pytest.raises(ValueError) as info:
        StopRule(**{field: value})
    message = str(info.value)
    assert field in message and words in message


# -- attempts without a result ---------------------------------------------------------------
def test_a_lost_trial_is_retried_a_bounded_number_of_times():
    from agent.history import MAX_LOST, MAX_TUNER_DEATHS
    history = History({REGION: ["cpu"]})
    history.add(_trial("x", "cpu", Status.lost))
    assert not history.done(REGION, "x", "cpu")  # lost with its worker: not a result, run again
    for _ in range(MAX_LOST - 1):
        history.add(_trial("x", "cpu", Status.lost))
    assert history.done(REGION, "x", "cpu") and history.tried(REGION, "x")  # and then no more
    history.interrupted[(REGION, "y", "cpu")] = MAX_TUNER_DEATHS - 1
    assert not history.done(REGION, "y", "cpu")
    history.interrupted[(REGION, "y", "cpu")] = MAX_TUNER_DEATHS
    assert history.done(REGION, "y", "cpu")


def _simulate_killed_sessions(run: RunFolder, source: str, times: int) -> None:
    store = run.store()
    for _ in range(times):
        store.event("session", pid=0)
        store.event("start", region=REGION, candidate=h(source), generation="cpu")
    store.close()


def test_a_trial_the_tuner_died_in_is_run_again_then_recorded_lost(run):
    other = SLOW.replace("{i}", "1")
    _simulate_killed_sessions(run, RIGHT, 1)
    outcome, _, history = run_loop(run, StubPlanner([RIGHT]), StopRule(max_candidates=10, patience=10))
    assert [t.status for t in stored(run)] == [Status.ok]  # interrupted once: simply run again

    from agent.history import MAX_TUNER_DEATHS
    _simulate_killed_sessions(run, other, MAX_TUNER_DEATHS)  # killed again and again in it: it may be the killer
    outcome, _, history = run_loop(run, StubPlanner([other, JUST_OUTSIDE]), StopRule(max_candidates=10, patience=10))
    by_hash = {t.candidate_hash: t for t in stored(run)}
    assert by_hash[h(other)].status is Status.lost
    assert f"the tuner stopped {MAX_TUNER_DEATHS} times" in by_hash[h(other)].reason
    assert by_hash[h(JUST_OUTSIDE)].status is Status.wrong  # the search went on past it
    assert outcome.stop_reason == "planners have nothing new to try"


def test_a_clean_stop_does_not_count_as_the_tuner_dying(run):
    store = run.store()
    for kind in ("session", "start", "cancel", "stop"):
        store.event(kind, region=REGION, candidate=h(RIGHT), generation="cpu", reason="interrupted (Ctrl-C)")
    assert store.unfinished() == {} and store.ended_cleanly()
    store.close()


class Raises(StubPlanner):
    def propose(self, problem, history, n):
        if history.trials:
            raise RuntimeError("the planner has a bug")
        return super().propose(problem, history, n)


def test_a_planner_exception_is_recorded_as_what_it_was(run):
    outcome, _, _ = run_loop(run, Raises([RIGHT, SLOW.replace("{i}", "0")]), StopRule(max_candidates=10, patience=10))
    assert outcome.stop_reason == "planner stub failed: RuntimeError: the planner has a bug"
    assert outcome.planner_failure == outcome.stop_reason
    store = run.store(readonly=True)
    try:
        assert store.last_event("stop")["reason"] == outcome.stop_reason  # not "interrupted"
        (error,) = store.events("planner_error")
        assert "Traceback" in error["detail"] and "the planner has a bug" in error["detail"]
    finally:
        store.close()


def test_the_trial_time_estimate_survives_a_resume(run):
    run_loop(run, StubPlanner([RIGHT, SLOW.replace("{i}", "0")]), StopRule(max_candidates=10, patience=10))
    history = load_history(run, run.problems(), ["cpu"])
    fresh = Budget(StopRule())
    fresh.remember(history.trials)
    costs = [max(0.0, t.gpu_seconds - t.phases.get("start", 0.0)) for t in history.trials]
    assert fresh.estimate(REGION) == pytest.approx(max(costs)) and fresh.estimate(REGION) < 20.0



class SlowSecondCall(StubPlanner):
    """The search is stopped (a signal) while its second call runs, inside torch for a while,
    once the first trial is in."""

    def __init__(self, sources):
        super().__init__(sources)
        self.trial_in, self.stopping, self.ended = threading.Event(), threading.Event(), False

    def propose(self, problem, history, n):
        if not self.count:
            self.count += 1
            return super().propose(problem, history, n)
        self.trial_in.wait(60)
        self.stopping.set()
        time.sleep(1.5)
        self.ended = True
        return []


def test_the_search_ends_after_the_planner_call_it_left_running(run):
    """A planner's daemon thread still inside torch when the process exits aborts it on Python
    3.11 (CI: a tune printed its JSON, then SIGABRT): the search waits a while for it."""
    problems, planner = run.problems(), SlowSecondCall([RIGHT])
    executor = LocalExecutor(parse_devices("cpu")[0], [run.problems_dir / p.name for p in problems], LIMITS)
    try:
        outcome = tune(run, problems, planner, executor, Budget(StopRule(max_candidates=10, patience=10)),
                       load_history(run, problems, executor.generations), on_trial=lambda t: planner.trial_in.set(),
                       should_stop=planner.stopping.is_set)
    finally:
        executor.close()
    assert planner.stopping.is_set() and planner.ended, outcome
