"""What has been tried, per region and candidate, across device generations.

A candidate is *kept* only when it passed the tolerance on every target generation; its
rank is its smallest speedup over those generations, since a win on one generation can be
a regression on another.

A (candidate, generation) whose attempt ends without a result is run again, a bounded number
of times: a `lost` trial (the worker was lost for reasons not the candidate's) once more
(`MAX_LOST`); a trial the tuner itself died in (killed, out of memory) until that has happened
`MAX_TUNER_DEATHS` times. A candidate that kills its worker's host, or the tuner, must not stop
every resume at the same place.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from tools.problem import Problem
from tools.runfolder import RunFolder
from tools.trial import Status, Trial

MAX_LOST = 2
"""`lost` trials of one (candidate, generation) before it is not run again."""
MAX_TUNER_DEATHS = 3
"""Times the tuner may die during one (candidate, generation) before it is recorded `lost`."""


@dataclass
class CandidateRecord:
    region: str
    candidate_hash: str
    template: str | None
    params: dict
    planner: str
    by_generation: dict[str, Trial] = field(default_factory=dict)

    def speedups(self) -> dict[str, float]:
        return {g: t.speedup for g, t in self.by_generation.items() if t.ranked}

    def kept(self, generations: list[str]) -> bool:
        return all(g in self.by_generation and self.by_generation[g].ranked for g in generations)

    def score(self, generations: list[str]) -> float:
        s = self.speedups()
        return min(s[g] for g in generations) if self.kept(generations) else 0.0

    def failed(self) -> Trial | None:
        return next((t for t in self.by_generation.values() if t.status is not Status.ok), None)


class History:
    def __init__(self, generations: dict[str, list[str]] | None = None):
        self.records: dict[tuple[str, str], CandidateRecord] = {}
        self.trials: list[Trial] = []
        self.generations = generations or {}
        """Per region: the generations a candidate must pass on."""
        self.pending: set[tuple[str, str]] = set()
        """(region, hash) of candidates in flight: planned already, so not to be proposed again."""
        self.lost: dict[tuple[str, str, str], int] = defaultdict(int)
        """(region, hash, generation) -> trials recorded `lost`."""
        self.interrupted: dict[tuple[str, str, str], int] = {}
        """(region, hash, generation) -> trials the tuner died in (started, never ended; from the store)."""

    def snapshot(self) -> "History":
        """A copy a planner can read in another thread while the loop keeps adding trials."""
        copy = History(self.generations)
        copy.trials = list(self.trials)
        copy.pending = set(self.pending)
        copy.lost = defaultdict(int, self.lost)
        copy.interrupted = dict(self.interrupted)
        for key, rec in list(self.records.items()):
            copy.records[key] = CandidateRecord(rec.region, rec.candidate_hash, rec.template, rec.params,
                                                rec.planner, dict(rec.by_generation))
        return copy

    def add(self, trial: Trial) -> CandidateRecord:
        self.trials.append(trial)
        key = (trial.region, trial.candidate_hash)
        rec = self.records.get(key)
        if rec is None:
            rec = self.records[key] = CandidateRecord(trial.region, trial.candidate_hash, trial.template,
                                                      trial.params, trial.planner)
        if trial.status is Status.lost:
            self.lost[(trial.region, trial.candidate_hash, trial.generation)] += 1
        rec.by_generation[trial.generation] = trial
        return rec


    def targets(self, region: str) -> list[str]:
        return self.generations.get(region) or sorted({t.generation for t in self.trials if t.region == region})

    def done(self, region: str, digest: str, generation: str) -> bool:
        """Finished on this generation. A trial `lost` with its worker is not a result, and is
        run again until the bounds on such attempts are reached."""
        rec = self.records.get((region, digest))
        trial = rec.by_generation.get(generation) if rec else None
        if trial is not None and trial.status is not Status.lost:
            return True
        key = (region, digest, generation)
        return self.lost.get(key, 0) >= MAX_LOST or self.interrupted.get(key, 0) >= MAX_TUNER_DEATHS

    def tried(self, region: str, digest: str) -> bool:
        """Finished on every target generation, or in flight now."""
        return (region, digest) in self.pending or all(self.done(region, digest, g) for g in self.targets(region))

    def region_records(self, region: str) -> list[CandidateRecord]:
        return [r for (reg, _), r in self.records.items() if reg == region]

    def kept(self, region: str) -> list[CandidateRecord]:
        gens = self.targets(region)
        recs = [r for r in self.region_records(region) if r.kept(gens)]
        return sorted(recs, key=lambda r: -r.score(gens))

    def best(self, region: str) -> CandidateRecord | None:
        kept = self.kept(region)
        return kept[0] if kept else None

    def failures(self, region: str, n: int = 5) -> list[Trial]:
        return [t for t in self.trials if t.region == region and t.status is not Status.ok][-n:]

    def counts(self, region: str) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for t in self.trials:
            if t.region == region:
                out[t.status.value] += 1
        return dict(out)


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
