"""The search loop: devices pull candidates as soon as they are free; the planner refills the queue.

    feed = queue of (candidate, generation) jobs              agent.search.feed: lanes take, the loop puts
    for trial in executor.run(feed):                           every lane takes the next job when free
        store.record(trial); history.add(trial)                on disk the moment each finishes
        if the feed runs low: plan in the background           planner.propose for every open region,
                                                               seeing every finished result
        stop on budget, candidate cap, patience, or a search space exhausted
    each region's best few timed again, side by side           in the room the budget held back for them

A lane's trial is screened against its region's best so far (tools/screen.py): a verified
candidate clearly slower than it is `screened`, not timed in full. There are no rounds: a trial
of minutes holds up its own lane only. Everything the loop needs
comes in as arguments; it knows nothing of CLIs, templates or workers. Resume is the same loop
over a store that already holds trials: finished (candidate, generation) pairs are never run
again, a trial `lost` with its worker is queued again (up to `agent.history.MAX_LOST`), and one
the tuner died in again and again (`MAX_TUNER_DEATHS`) is recorded `lost` instead of stopping
every resume there. A planner that raises ends the run with that error as its stop reason. The
planners having nothing new is an end only once nothing is in flight and they saw every result;
then the stop reason says how much of their spaces was tried.
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

from agent.search.budget import Budget
from agent.search.feed import Feed, Job
from agent.history import MAX_TUNER_DEATHS, CandidateRecord, History
from agent.planners import Planner, PlannerFailed
from tools.problem import Problem
from tools.runfolder import RunFolder
from tools.screen import Bars, ScreenBar
from tools.trial import Candidate, Status, Trial

PLANNER_GRACE_S = 10.0
"""How long the end of a search waits for a planner call still running: a daemon thread inside
torch when the interpreter exits aborts the process on Python 3.11 (its threads are unwound
through C++ code). A local planner ends well within it; an LLM call still waiting on its API is
left (a socket wait is safe to unwind)."""


class Executor(Protocol):
    generations: list[str]

    def run(self, feed: Feed, budget: Budget, should_stop: Callable[[], bool],
            on_start: Callable[[Candidate, str], None],
            screen: Callable[[str, str], ScreenBar | None]) -> Iterator[Trial | None]:
        """Trials as they finish, and None while none did; ends once the feed is closed and
        drained, the budget is spent, or `should_stop`. `screen(region, generation)`: the bar a
        launch is screened against (tools/screen.py), read as it starts."""
        ...


@dataclass
class Outcome:
    stop_reason: str
    trials_run: int
    plans: int
    """Times the planners' proposals fed the queue."""
    best: dict[str, float] = field(default_factory=dict)
    planner_failure: str = ""
    """Why the planners could propose nothing more, when that was a failure (an API that kept
    failing, answers that could not be read, a planner that raised), not a finished search."""
    generations: list[str] = field(default_factory=list)
    """The hardware generations the candidates were tried on (set by agent.search.tuning.run_tune)."""


def tune(run: RunFolder, problems: list[Problem], planner: Planner, executor: Executor, budget: Budget,
         history: History, on_trial: Callable[[Trial], None] = lambda t: None,
         should_stop: Callable[[], bool] = lambda: False, batch_per_device: int = 2, screen: bool = False,
         retime: bool = False) -> Outcome:
    """Until a stop rule fires. The planner is asked again whenever fewer jobs wait than there
    are lanes, so a lane never waits while a planner (an LLM, say) thinks; it sees every
    result finished by then, and the jobs queued or running as tried. `screen`: a verified candidate
    clearly slower than its region's best so far is not timed in full (off unless asked: the command
    turns it on for GPU timings only). `retime`: each region's finalists are timed again at the end."""
    store = run.store()
    bars = Bars(screen)

    def update_bar(region: str, generation: str) -> None:
        bars.update(region, generation, [r.by_generation[generation] for r in history.region_records(region)
                                         if generation in r.by_generation])
    for region, generation in {(t.region, t.generation) for t in history.trials}:
        update_bar(region, generation)
    store.event("session", pid=os.getpid())
    for rec in history.records.values():  # patience picks up where a resumed run left off
        budget.observe(rec.region, rec.score(history.targets(rec.region)) or None)
    _give_up_on_interrupted(store, history)
    plans = trials_run = 0
    failure = ""
    lanes = max(1, len(getattr(executor, "runners", [])) or len(executor.generations))
    feed = _BudgetedFeed(executor.generations, budget)
    fed: dict[tuple[str, str, str], Job] = {}  # (region, hash, generation) -> job queued or running
    started: dict[tuple[str, str, str], int] = {}
    planning: Future | None = None
    asked_at, came_back_empty = -1, False  # results in when the planner was last asked; whether it had nothing

    def plan() -> list[Candidate]:
        snapshot = history.snapshot()
        open_regions = [p for p in problems if budget.region_open(p.name)]
        n = max(1, (batch_per_device * lanes - feed.waiting()) // max(1, len(open_regions)))
        out = []
        for p in open_regions:
            try:
                out += planner.propose(p, snapshot, n)
            except PlannerFailed:
                raise
            except Exception as e:  # a planner's bug ends the run with what it was, not as "interrupted"
                raise PlannerFailed(planner.name, e) from e
        return out

    def enqueue(candidates: list[Candidate]) -> int:
        candidates, jobs = interleaved(candidates), []
        # Candidates already counted (tried on some generations, e.g. before a resume)
        # finish their remaining generations without counting against the cap again.
        known = [c for c in candidates if (c.region, c.hash) in history.records]
        new = [c for c in candidates if (c.region, c.hash) not in history.records]
        for c in known + new[: budget.admit(len(new))]:
            path = str(run.save_candidate(c.source, c.hash))
            jobs += [(c, g, path) for g in history.targets(c.region) if not history.done(c.region, c.hash, g)]
        feed.put(jobs)
        fed.update({(c.region, c.hash, g): (c, g, path) for c, g, path in jobs})
        history.pending = {(r, d) for r, d, _ in fed}
        return len(jobs)

    def drop_closed_regions() -> None:  # patience ended their search: what is queued is not run
        for p in problems:
            if not budget.region_open(p.name):
                for c, g, _ in feed.drop(p.name):
                    fed.pop((c.region, c.hash, g), None)
        history.pending = {(r, d) for r, d, _ in fed}

    def stop(reason: str) -> None:  # what is queued and running finishes and is recorded; nothing new comes
        budget.stop_reason = budget.stop_reason or reason
        feed.close()

    def record_final(trial: Trial) -> None:  # a finalist's new trial replaces its earlier one in the ranking
        store.record(trial)
        started.pop(key_of(trial), None)
        history.add(trial)
        on_trial(trial)

    def on_start(c: Candidate, generation: str) -> None:  # from executor threads; the store serializes
        key = (c.region, c.hash, generation)
        started[key] = started.get(key, 0) + 1
        store.event("start", region=c.region, candidate=c.hash, generation=generation)

    try:
        planning, asked_at = _in_background(plan), len(history.trials)
        for trial in executor.run(feed, budget, should_stop, on_start, bars):
            if trial is not None:
                key = key_of(trial)
                store.record(trial)
                started.pop(key, None)
                rec = history.add(trial)
                trials_run += 1
                job = fed.pop(key, None)
                if trial.status is Status.lost and job and not feed.closed and not history.done(*key):
                    feed.put([job], front=True)  # the worker was lost, not the candidate: once more
                    fed[key] = job
                history.pending = {(r, d) for r, d, _ in fed}
                if rec.kept(history.targets(rec.region)) or trial.ranked:
                    budget.observe(rec.region, rec.score(history.targets(rec.region)) or None)
                elif trial.status is Status.screened:  # a passing trial that brought no gain
                    budget.observe(rec.region, 0.0)
                update_bar(trial.region, trial.generation)
                if retime:
                    budget.hold({region: len(recs) for region, recs in finalists(history, problems).items()})
                on_trial(trial)
            if should_stop() or feed.closed:
                continue
            drop_closed_regions()
            if not any(budget.region_open(p.name) for p in problems):
                stop("patience: no region improved for a while")
                continue
            if planning is not None and planning.done():
                try:
                    added = enqueue(_unique(planning.result(), history))
                except PlannerFailed as e:
                    store.event("planner_error", planner=e.planner, error=str(e), detail=e.detail)
                    failure = str(e)
                    stop(failure)
                    continue
                planning, plans, came_back_empty = None, plans + bool(added), not added
            # Nothing new, having seen every result so far: asked again only once another is in.
            idle_planner = came_back_empty and asked_at == len(history.trials)
            if budget.stop_reason.startswith("candidate cap"):
                stop(budget.stop_reason)
            elif idle_planner and not fed and planning is None:  # nothing queued or running could change its mind
                stopped, failure = _planner_stops(planner)
                stop(stopped or _exhausted(planner, [p for p in problems if budget.region_open(p.name)], history))
            elif planning is None and feed.waiting() < lanes and not idle_planner:
                planning, asked_at, came_back_empty = _in_background(plan), len(history.trials), False
        if retime and not should_stop() and not failure:
            trials_run += _retime_finalists(run, problems, history, executor, budget, should_stop, on_start,
                                            record_final)
    finally:
        if planning is not None:  # its thread may be inside torch: see PLANNER_GRACE_S
            wait([planning], timeout=PLANNER_GRACE_S)
        for (region, digest, generation), n in started.items():  # a clean stop cut these short
            for _ in range(n):
                store.event("cancel", region=region, candidate=digest, generation=generation)
        store.event("stop", reason=budget.stop_reason or "interrupted", trials=trials_run)
        store.close()
    best = {p.name: (b.score(history.targets(p.name)) if (b := history.best(p.name)) else 0.0) for p in problems}
    return Outcome(budget.stop_reason or "interrupted", trials_run, plans, best, failure)


def key_of(trial: Trial) -> tuple[str, str, str]:
    return trial.region, trial.candidate_hash, trial.generation


RETIME_TOP = 3
"""The best candidates of a region re-timed side by side when the search ends, before integration
reads the ranking (Inductor's max-autotune re-times its top few: fewer wrong winners)."""


def finalists(history: History, problems: list[Problem]) -> dict[str, list[CandidateRecord]]:
    """Per region with two wins or more (faster than the original beyond the noise band on every
    target generation: only a win is integrated), its best RETIME_TOP."""
    out = {}
    for p in problems:
        gens = history.targets(p.name)
        wins = [r for r in history.kept(p.name) if all(r.by_generation[g].win for g in gens)]
        if len(wins) >= 2:
            out[p.name] = wins[:RETIME_TOP]
    return out


def _retime_finalists(run: RunFolder, problems: list[Problem], history: History, executor: Executor, budget: Budget,
                      should_stop: Callable[[], bool], on_start: Callable[[Candidate, str], None],
                      record: Callable[[Trial], object]) -> int:
    """Each region's finalists tried again one after another on the same trial path (verified
    again, timed in full, never screened) in the room the budget held back for them; their new
    trials replace their earlier ones in the ranking. Returns how many ran."""
    jobs = []
    for recs in finalists(history, problems).values():
        for rec in recs:
            path = run.candidates_dir / f"{rec.candidate_hash}.py"
            c = Candidate(region=rec.region, source=path.read_text(), planner=rec.planner, template=rec.template,
                          params=rec.params)
            jobs += [(c, g, str(path)) for g in history.targets(rec.region)]
    if not jobs:
        return 0
    reason = budget.stop_reason
    budget.release_held()
    feed = _BudgetedFeed(executor.generations, budget)
    feed.put(jobs)
    feed.close()
    ran = 0
    for trial in executor.run(feed, budget, should_stop, on_start, lambda region, generation: None):
        if trial is not None:
            trial.flags.append(f"re-timed side by side with its region's best {RETIME_TOP} when the search ended")
            record(trial)
            ran += 1
    budget.stop_reason = reason or budget.stop_reason
    return ran


def interleaved(candidates: list[Candidate]) -> list[Candidate]:
    """Every region's first candidate before any region's second, each region's in the planner's
    order: queued region by region, a short night (or the candidate cap) spent every trial on
    the first region (transformers' LlamaModel on the H200: 5 of 5 trials on attention)."""
    by_region: dict[str, list[Candidate]] = {}
    for c in candidates:
        by_region.setdefault(c.region, []).append(c)
    return [c for row in itertools.zip_longest(*by_region.values()) for c in row if c is not None]


class _BudgetedFeed(Feed):
    """The feed, telling the budget which region a lane takes a job of: executors launch by
    device, and a launch is estimated by what that region's trials cost (agent/search/budget.py)."""

    def __init__(self, generations: list[str], budget: Budget):
        super().__init__(generations)
        self.budget = budget

    def take(self, generation: str, timeout: float = 0.0) -> Job | None:
        job = super().take(generation, timeout)
        if job is not None:
            self.budget.taking(job[0].region)
        return job


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


def _exhausted(planner: Planner, problems: list[Problem], history: History) -> str:
    """Why planners with nothing new stop: every space tried (with its size), where the planners
    know their spaces; else just that."""
    members = getattr(planner, "planners", [planner])
    if not all(hasattr(p, "coverage") for p in members):
        return "planners have nothing new to try"
    tried = size = 0
    for problem in problems:
        for p in members:
            t, s = p.coverage(problem, history)
            tried, size = tried + t, size + s
    if tried >= size:
        return f"search space exhausted: {tried} of {size} candidates tried"
    return f"planners have nothing new to try ({tried} of the {size} candidates of their spaces tried)"
