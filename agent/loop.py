"""The search loop: propose a batch, verify and time it on idle devices, record, repeat.

    while budget and patience allow:
        batch   = planner.propose(problem, history)    for every open region
        trials  = executor.run(batch)                  verified, timed, in parallel
        store.record(trial); history.add(trial)        on disk the moment each finishes

Everything the loop needs comes in as arguments; it knows nothing of CLIs, templates or
workers. Resume is the same loop over a store that already holds trials: finished
(candidate, generation) pairs are never run again.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

from agent.budget import Budget
from agent.history import History
from agent.planners import Planner
from tools.problem import Problem
from tools.runfolder import RunFolder
from tools.trial import Candidate, Trial


class Executor(Protocol):
    generations: list[str]

    def run(self, jobs: list[tuple[Candidate, str, str]], budget: Budget,
            should_stop: Callable[[], bool]) -> Iterator[Trial]: ...


@dataclass
class Outcome:
    stop_reason: str
    trials_run: int
    rounds: int
    best: dict[str, float] = field(default_factory=dict)


def load_history(run: RunFolder, problems: list[Problem], generations: list[str]) -> History:
    history = History({p.name: p.target_generations or generations for p in problems})
    store = run.store()
    for trial in store.trials():
        history.add(trial)
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
    for rec in history.records.values():  # patience picks up where a resumed run left off
        budget.observe(rec.region, rec.score(history.targets(rec.region)) or None)
    rounds = trials_run = 0
    lanes = max(1, len(getattr(executor, "runners", [])) or len(executor.generations))

    def plan() -> list[Candidate]:
        snapshot = history.snapshot()
        open_regions = [p for p in problems if budget.region_open(p.name)]
        n = max(1, batch_per_device * lanes // max(1, len(open_regions)))
        return [c for p in open_regions for c in planner.propose(p, snapshot, n)]

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nightshift-planner")
    try:
        upcoming, prefetched = pool.submit(plan), False
        while not should_stop():
            if not any(budget.region_open(p.name) for p in problems):
                budget.stop_reason = budget.stop_reason or "patience: no region improved for a while"
                break
            jobs = []
            fresh = _unique(upcoming.result(), history)
            # Candidates already counted (tried on some generations, e.g. before a resume)
            # finish their remaining generations without counting against the cap again.
            known = [c for c in fresh if (c.region, c.hash) in history.records]
            new = [c for c in fresh if (c.region, c.hash) not in history.records]
            for c in known + new[: budget.admit(len(new))]:
                path = str(run.save_candidate(c.source, c.hash))
                jobs += [(c, g, path) for g in history.targets(c.region) if not history.done(c.region, c.hash, g)]
            if not jobs and prefetched:  # planned before the last results: ask again with them
                upcoming, prefetched = pool.submit(plan), False
                continue
            if not jobs:
                budget.stop_reason = budget.stop_reason or _idle_reason(planner)
                break
            rounds += 1
            upcoming, prefetched = None, False
            history.pending = {(c.region, c.hash) for c, _, _ in jobs}
            for done, trial in enumerate(executor.run(jobs, budget, should_stop), 1):
                store.record(trial)
                rec = history.add(trial)
                trials_run += 1
                if rec.kept(history.targets(rec.region)) or trial.ranked:
                    budget.observe(rec.region, rec.score(history.targets(rec.region)) or None)
                on_trial(trial)
                if upcoming is None and done >= prefetch_at * len(jobs) and done < len(jobs):
                    upcoming, prefetched = pool.submit(plan), True
            history.pending = set()
            upcoming = upcoming or pool.submit(plan)
            if budget.stop_reason.startswith("GPU-hours"):
                break
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        store.event("stop", reason=budget.stop_reason or "interrupted", trials=trials_run)
        store.close()
    best = {p.name: (b.score(history.targets(p.name)) if (b := history.best(p.name)) else 0.0) for p in problems}
    return Outcome(budget.stop_reason or "interrupted", trials_run, rounds, best)


def _unique(candidates: list[Candidate], history: History) -> list[Candidate]:
    seen, out = set(), []
    for c in candidates:
        if (c.region, c.hash) not in seen and not history.tried(c.region, c.hash):
            seen.add((c.region, c.hash))
            out.append(c)
    return out


def _idle_reason(planner: Planner) -> str:
    stopped = [p.stopped for p in getattr(planner, "planners", [planner]) if getattr(p, "stopped", "")]
    return stopped[0] if stopped else "planners have nothing new to try"
