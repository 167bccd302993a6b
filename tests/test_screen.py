"""Screen, then measure (issue 49): a verified candidate clearly slower than its region's best so
far is `screened` after one timed round, never ranked; a sample of those is timed in full to
count the screen's misses; the best few per region are timed again when the search ends; and the
GPU-hours cap stops trials still running when it is reached."""

from __future__ import annotations

import time

import pytest

from agent.search.budget import Budget
from sandbox.runner import Limits, TrialRunner
from tools import screen
from tools.problem import StopRule
from tools.trial import Candidate, Status, Trial, WorkloadTiming

OWN = "def forward(module, *args, **kwargs):\n    return type(module).forward(module, *args, **kwargs)\n"


def timing(name: str, speedup: float, band: float = 0.05) -> WorkloadTiming:
    return WorkloadTiming(workload=name, baseline_ms=1.0, candidate_ms=1.0 / speedup, baseline_spread=0.01,
                          candidate_spread=0.01, reps=10, speedup=speedup, noise_band=band)


def ranked(digest: str, per: dict[str, float]) -> Trial:
    timings = [timing(w, s) for w, s in per.items()]
    return Trial(region="R", candidate_hash=digest, status=Status.ok, timings=timings, noise_band=0.05,
                 speedup=len(per) / sum(1 / s for s in per.values()))


def test_only_a_candidate_slower_than_the_best_everywhere_beyond_the_margin_is_dropped():
    bar = screen.bar([ranked("a", {"w1": 2.0, "w2": 1.0}), ranked("b", {"w1": 1.0, "w2": 3.0})])
    assert bar.best == "b" and bar.workloads == {"w1": (2.0, 0.05), "w2": (3.0, 0.05)}
    weights = {"w1": 1.0, "w2": 1.0}
    slow = screen.verdict(bar, weights, [timing("w1", 0.5), timing("w2", 0.5)])
    assert slow is not None and slow["best"] == "b" and slow["ratio"]["w2"] == 6.0 and not slow["audited"]
    # Fastest on one workload (integration's dispatcher would route it there): a contender.
    assert screen.verdict(bar, weights, [timing("w1", 2.1), timing("w2", 0.5)]) is None
    # Slower, but within the margin on one workload: a contender.
    assert screen.verdict(bar, weights, [timing("w1", 0.5), timing("w2", 2.5)]) is None
    # A round as noisy as ±60%: the bands widen the margin past 2.4x.
    assert screen.verdict(bar, weights, [timing("w1", 0.8, 0.6), timing("w2", 1.2, 0.6)]) is None
    # A workload the best was never timed on: nothing to compare with there.
    assert screen.verdict(bar, weights, [timing("w1", 0.1), timing("w3", 0.1)]) is None


def test_misses_count_audited_candidates_that_beat_the_best_they_were_screened_against():
    bar = screen.bar([ranked("a", {"w": 2.0})])
    rec = screen.verdict(screen.ScreenBar(bar.best, bar.speedup, bar.band, bar.workloads, audit=True), {"w": 1.0},
                         [timing("w", 0.4)])
    assert rec["audited"]
    dropped = Trial(region="R", candidate_hash="d", status=Status.screened, screen={**rec, "audited": False})
    beat = ranked("e", {"w": 2.5}).model_copy(update={"screen": rec})
    lost = ranked("f", {"w": 0.5}).model_copy(update={"screen": rec})
    assert screen.misses([dropped, beat, lost, ranked("g", {"w": 3.0})]) == (1, 2, 1)
    assert "1 of them beat that best (50%)" in screen.summary([dropped, beat, lost])


def test_bars_follow_the_best_and_audit_a_share_of_launches():
    bars = screen.Bars()
    assert bars("R", "cpu") is None
    bars.update("R", "cpu", [ranked("a", {"w": 2.0}), Trial(region="R", candidate_hash="x", status=Status.wrong)])
    got = [bars("R", "cpu") for _ in range(400)]
    assert {g.best for g in got} == {"a"}
    assert 10 < sum(g.audit for g in got) < 80  # AUDIT_SHARE of 400, drawn
    off = screen.Bars(on=False)
    off.update("R", "cpu", [ranked("a", {"w": 2.0})])
    assert off("R", "cpu") is None


@pytest.fixture
def runner(frozen_run):
    r = TrialRunner("cpu", Limits(compile_s=60, run_s=30, time_s=60, budget_ms=20, max_reps=5))
    r.add_problem(frozen_run / "LlamaRMSNorm")
    yield r
    r.close()


def test_a_verified_candidate_far_slower_than_the_best_is_screened_and_never_a_timing(runner):
    """On the real trial path; the bars are made up (a best a million times faster than the
    original, or a million times slower), so no CPU timing decides what the test expects."""
    workloads = [w.name for w in runner.problems["LlamaRMSNorm"].problem.workloads]

    def made_up(speedup: float, audit: bool = False) -> screen.ScreenBar:
        return screen.ScreenBar("b" * 16, speedup, 0.0, {w: (speedup, 0.0) for w in workloads}, audit)
    own = Candidate(region="LlamaRMSNorm", source=OWN)
    dropped = runner.run(own, screen=made_up(1e6))
    assert dropped.status is Status.screened, dropped.reason
    assert not dropped.ranked and dropped.speedup is None and not dropped.timings
    assert dropped.error is not None and dropped.fresh_error is not None  # verified as any other
    assert dropped.screen["best"] == "b" * 16 and dropped.screen["ratio"]["overall"] > 1e4
    # Drawn for the audit: timed in full (every round), ranked, the screen's record kept.
    audited = runner.run(own, screen=made_up(1e6, audit=True))
    assert audited.status is Status.ok and audited.ranked and audited.screen["audited"]
    assert all(len(t.baseline_runs) >= 2 for t in audited.timings)
    # Faster than the best: a contender, timed in full, no record.
    contender = runner.run(own, screen=made_up(1e-6))
    assert contender.status is Status.ok and contender.ranked and contender.screen is None
    assert all(len(t.baseline_runs) >= 2 for t in contender.timings)


def test_the_cap_stops_a_trial_still_running_when_it_is_reached(frozen_run, monkeypatch):
    """A trial that runs past what is left of the cap is stopped there, `lost` (run again by a
    resume with more hours) and charged what it held; nothing is launched after it."""
    from agent.search import budget as budget_module
    from agent.executors.local import LocalExecutor, Slot
    from agent.search.feed import Feed
    monkeypatch.setattr(budget_module, "DEFAULT_TRIAL_SECONDS", 1.0)  # this first trial fits 10 s
    cap = 10.0
    budget = Budget(StopRule(gpu_hours=cap / 3600))
    ex = LocalExecutor([Slot("cpu", "cpu")], [frozen_run / "LlamaRMSNorm"],
                       Limits(compile_s=120, run_s=30, time_s=60, budget_ms=20, max_reps=5))
    sleepy = Candidate(region="LlamaRMSNorm", source="import time\ntime.sleep(60)\n" + OWN)
    warm = ex.pools["cpu"].run(Candidate(region="LlamaRMSNorm", source=OWN), do_time=False)  # workers started
    assert warm.status is Status.ok, warm.reason
    feed = Feed(["cpu"])
    feed.put([(sleepy, "cpu", ""), (Candidate(region="LlamaRMSNorm", source=OWN), "cpu", "")])
    feed.close()
    t0 = time.monotonic()
    try:
        trials = [t for t in ex.run(feed, budget) if t is not None]
    finally:
        ex.close()
    assert time.monotonic() - t0 < 40  # not the candidate's 60 s
    assert [t.status for t in trials] == [Status.lost] and "GPU-hours cap" in trials[0].reason
    assert budget.exhausted and "cap" in budget.stop_reason
    assert cap <= budget.spent < cap + 3.0, budget.spent  # stopped within moments of the cap
