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
         should_stop: Callable[[], bool] = lambda: False, batch_per_device: int = 2) -> Outcome:
    store = run.store()
    for rec in history.records.values():  # patience picks up where a resumed run left off
        budget.observe(rec.region, rec.score(history.targets(rec.region)) or None)
    rounds = trials_run = 0
    try:
        while not should_stop():
            open_regions = [p for p in problems if budget.region_open(p.name)]
            if not open_regions:
                budget.stop_reason = budget.stop_reason or "patience: no region improved for a while"
                break
            n = max(1, batch_per_device * len(executor.generations) * 2 // len(open_regions))
            jobs = []
            for problem in open_regions:
                fresh = [c for c in planner.propose(problem, history, n) if not history.tried(c.region, c.hash)]
                for c in fresh[: budget.admit(len(fresh))]:
                    path = str(run.save_candidate(c.source, c.hash))
                    jobs += [(c, g, path) for g in history.targets(problem.name)
                             if not history.done(c.region, c.hash, g)]
            if not jobs:
                budget.stop_reason = budget.stop_reason or "planners have nothing new to try"
                break
            rounds += 1
            for trial in executor.run(jobs, budget, should_stop):
                store.record(trial)
                rec = history.add(trial)
                trials_run += 1
                if rec.kept(history.targets(rec.region)) or trial.ranked:
                    budget.observe(rec.region, rec.score(history.targets(rec.region)) or None)
                on_trial(trial)
            if budget.stop_reason.startswith("GPU-hours"):
                break
    finally:
        store.event("stop", reason=budget.stop_reason or "interrupted", trials=trials_run)
        store.close()
    best = {p.name: (b.score(history.targets(p.name)) if (b := history.best(p.name)) else 0.0) for p in problems}
    return Outcome(budget.stop_reason or "interrupted", trials_run, rounds, best)
