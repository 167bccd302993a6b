"""The search loop: propose a batch, verify and time it on idle devices, record, repeat.

    while budget and patience allow:
        batch   = planner.propose(problem, history)    for every open region
        trials  = executor.run(batch)                  verified, timed, in parallel
        store.record(trial); history.add(trial)        on disk the moment each finishes

Everything the loop needs comes in as arguments; it knows nothing of CLIs, templates or
workers. Resume is the same loop over a store that already holds trials: finished
(candidate, generation) pairs are never run again, and one the tuner died in again and again
(`agent.history.MAX_TUNER_DEATHS`) is recorded `lost` instead of stopping every resume there.
A planner that raises ends the run with that error as its stop reason, recorded as such.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

from agent.budget import Budget
from agent.history import MAX_TUNER_DEATHS, History
from agent.planners import Planner, PlannerFailed
from tools.problem import Problem
from tools.runfolder import RunFolder
from tools.trial import Candidate, Status, Trial


class Executor(Protocol):
    generations: list[str]

    def run(self, jobs: list[tuple[Candidate, str, str]], budget: Budget, should_stop: Callable[[], bool],
            on_start: Callable[[Candidate, str], None]) -> Iterator[Trial]: ...


@dataclass
class Outcome:
    stop_reason: str
    trials_run: int
    rounds: int
    best: dict[str, float] = field(default_factory=dict)
    planner_failure: str = ""
    """Why the planners could propose nothing more, when that was a failure (an API that kept
    failing, answers that could not be read, a planner that raised), not a finished search."""


def load_history(run: RunFolder, problems: list[Problem], generations: list[str]) -> History:
    history = History({p.name: p.target_generations or generations for p in problems})
    if not run.check_store():
        return history
    store = run.store(readonly=True)
    try:
        for trial in store.trials():
            history.add(trial)
        history.interrupted = store.unfinished()
    finally:
        store.close()
    return history


def tune(run: RunFolder, problems: list[Problem], planner: Planner, executor: Executor, budget: Budget,
         history: History, on_trial: Callable[[Trial], None] = lambda t: None,
         should_stop: Callable[[], bool] = lambda: False, batch_per_device: int = 2,
         prefetch_at: float = 0.5) -> Outcome:
    """Rounds until a stop rule fires. The next round is planned in the background once
    `prefetch_at` of the current round has finished, so devices do not wait while a planner
    (an LLM, say) thinks; that plan sees every result finished by then, and the candidates
    still in flight as tried. A prefetched plan with nothing new is not the end: the planner
    is asked once more with the whole round's results before the run stops as idle."""
    store = run.store()
    store.event("session", pid=os.getpid())
    for rec in history.records.values():  # patience picks up where a resumed run left off
        budget.observe(rec.region, rec.score(history.targets(rec.region)) or None)
    _give_up_on_interrupted(store, history)
    rounds = trials_run = 0
    failure = ""
    lanes = max(1, len(getattr(executor, "runners", [])) or len(executor.generations))
    started: dict[tuple[str, str, str], int] = {}

    def plan() -> list[Candidate]:
        snapshot = history.snapshot()
        open_regions = [p for p in problems if budget.region_open(p.name)]
        n = max(1, batch_per_device * lanes // max(1, len(open_regions)))
        out = []
        for p in open_regions:
            try:
                out += planner.propose(p, snapshot, n)
            except PlannerFailed:
                raise
            except Exception as e:  # a planner's bug ends the run with what it was, not as "interrupted"
                raise PlannerFailed(planner.name, e) from e
        return out

    def on_start(c: Candidate, generation: str) -> None:  # from executor threads; the store serializes
        key = (c.region, c.hash, generation)
        started[key] = started.get(key, 0) + 1
        store.event("start", region=c.region, candidate=c.hash, generation=generation)

    try:
        upcoming, prefetched = _in_background(plan), False
        while not should_stop():
            if not any(budget.region_open(p.name) for p in problems):
                budget.stop_reason = budget.stop_reason or "patience: no region improved for a while"
                break
            try:
                proposed = _result_unless_stopped(upcoming, should_stop)
                if proposed is None:  # stopped while a planner (an LLM call, say) was still thinking
                    break
                fresh = _unique(proposed, history)
            except PlannerFailed as e:
                store.event("planner_error", planner=e.planner, error=str(e), detail=e.detail)
                budget.stop_reason = failure = str(e)
                break
            jobs = []
            # Candidates already counted (tried on some generations, e.g. before a resume)
            # finish their remaining generations without counting against the cap again.
            known = [c for c in fresh if (c.region, c.hash) in history.records]
            new = [c for c in fresh if (c.region, c.hash) not in history.records]
            for c in known + new[: budget.admit(len(new))]:
                path = str(run.save_candidate(c.source, c.hash))
                jobs += [(c, g, path) for g in history.targets(c.region) if not history.done(c.region, c.hash, g)]
            if not jobs and prefetched:  # planned before the last results: ask again with them
                upcoming, prefetched = _in_background(plan), False
                continue
            if not jobs:
                stopped, failure = _planner_stops(planner)
                budget.stop_reason = budget.stop_reason or stopped or "planners have nothing new to try"
                break
            rounds += 1
            upcoming, prefetched = None, False
            history.pending = {(c.region, c.hash) for c, _, _ in jobs}
            for done, trial in enumerate(executor.run(jobs, budget, should_stop, on_start), 1):
                store.record(trial)
                started.pop((trial.region, trial.candidate_hash, trial.generation), None)
                rec = history.add(trial)
                trials_run += 1
                if rec.kept(history.targets(rec.region)) or trial.ranked:
                    budget.observe(rec.region, rec.score(history.targets(rec.region)) or None)
                on_trial(trial)
                if upcoming is None and done >= prefetch_at * len(jobs) and done < len(jobs):
                    upcoming, prefetched = _in_background(plan), True
            history.pending = set()
            upcoming = upcoming or _in_background(plan)
            if budget.stop_reason.startswith("GPU-hours"):
                break
    finally:
        for (region, digest, generation), n in started.items():  # a clean stop cut these short
            for _ in range(n):
                store.event("cancel", region=region, candidate=digest, generation=generation)
        store.event("stop", reason=budget.stop_reason or "interrupted", trials=trials_run)
        store.close()
    best = {p.name: (b.score(history.targets(p.name)) if (b := history.best(p.name)) else 0.0) for p in problems}
    return Outcome(budget.stop_reason or "interrupted", trials_run, rounds, best, failure)


def _in_background(fn: Callable[[], list[Candidate]]) -> Future:
    """Plan in a daemon thread: a stop (or the end of the process) never waits for a planner
    that is still waiting on an API."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the loop, which says what it was
            future.set_exception(e)

    threading.Thread(target=run, daemon=True, name="nightshift-planner").start()
    return future


def _result_unless_stopped(future: Future, should_stop: Callable[[], bool]) -> list[Candidate] | None:
    while True:
        try:
            return future.result(timeout=0.25)
        except FutureTimeout:
            if should_stop():
                return None


def _give_up_on_interrupted(store, history: History) -> None:
    """A trial the tuner died in `MAX_TUNER_DEATHS` times is recorded `lost`, with why, and not
    run again (it may be what kills the tuner: memory, a hang that the OS ended)."""
    for (region, digest, generation), n in sorted(history.interrupted.items()):
        rec = history.records.get((region, digest))
        if n < MAX_TUNER_DEATHS or (rec and generation in rec.by_generation):
            continue
        source = rec.by_generation[next(iter(rec.by_generation))] if rec else None
        trial = Trial(region=region, candidate_hash=digest, status=Status.lost, generation=generation,
                      device=generation, planner=source.planner if source else "",
                      template=source.template if source else None,
                      reason=f"the tuner stopped {n} times while this trial ran (killed, or out of memory); "
                             "not run again")
        store.record(trial)
        history.add(trial)


def _unique(candidates: list[Candidate], history: History) -> list[Candidate]:
    seen, out = set(), []
    for c in candidates:
        if (c.region, c.hash) not in seen and not history.tried(c.region, c.hash):
            seen.add((c.region, c.hash))
            out.append(c)
    return out


def _planner_stops(planner: Planner) -> tuple[str, str]:
    """(why planners stopped proposing, other than running out of ideas: a dollar cap, an API
    that kept failing, ...; the failure when every planner failed, else '')."""
    members = getattr(planner, "planners", [planner])
    failed = getattr(planner, "failed", {})
    failures = [getattr(p, "failure", "") or (str(failed[p.name]) if p.name in failed else "") for p in members]
    stops = [getattr(p, "stopped", "") or f for p, f in zip(members, failures)]
    return "; ".join(s for s in stops if s), "; ".join(failures) if all(failures) else ""
