"""A corpus's search, planned: its problem classes, each model's share of the budget, and the
class planner each model's search runs under.

The budget is split by time. A class's share is its members' time in their models (each
model's time weighted by its `--model-weight`) over the corpus's frozen time. A class's leader
gets its class's whole share, less `RESERVE` where some class has members: the members' part,
for verifying their class's winners on their own problems and, where none passes, their own
search, split among them by their time. A model's cap is the sum of its regions' parts, plus
what the models before it left unspent, at least `FLOOR_SECONDS` per region where the corpus
has that left, and never more than the corpus has left: the models' caps together never pass
`--gpu-hours`. The candidate cap is split alike (at least one per region), a member's winners
to verify (`SHARE_TOP` at most) on top.
"""

from __future__ import annotations

from typing import Callable

from agent.history import load_history
from agent.planners import Planner
from agent.planners.shared import SHARE_TOP, ClassPlanner, Shared
from tools.classes import group
from tools.corpus import ClassRecord, CorpusInfo
from tools.problem import Problem, StopRule
from tools.runfolder import RunFolder
from tools.trial import Candidate

RESERVE = 0.15
"""The members' part of the budget, where some class has members."""
FLOOR_SECONDS = 60.0
"""Device seconds per region a model's cap is raised to where the corpus has them left: a share
smaller than one trial would start nothing."""


def region_ms(problem: Problem) -> float:
    """One model forward's time in the region, weighted over its workloads (the profile's)."""
    weights = problem.weights
    ms = sum(weights[w.name] * (w.baseline_ms or 0.0) * w.calls_per_forward for w in problem.workloads)
    return ms if ms > 0 else problem.share_of_model


def classify(runs: dict[str, RunFolder], weights: dict[str, float]) -> list[ClassRecord]:
    """The classes of every frozen problem, models in corpus order, with each class's share."""
    problems = {(name, p.name): p for name, run in runs.items() for p in run.problems()}
    classes = group([(name, p) for (name, _), p in problems.items()])
    time = {c.key: sum(weights.get(m.model, 1.0) * region_ms(problems[(m.model, m.region)]) for m in c.members)
            for c in classes}
    total = sum(time.values()) or 1.0
    return [ClassRecord(key=c.key, members=[(m.model, m.region) for m in c.members], share=time[c.key] / total)
            for c in classes]


def _parts(info: CorpusInfo, runs: dict[str, RunFolder]) -> dict[tuple[str, str], float]:
    """(model, region) -> its part of the budget (they sum to 1)."""
    classes = info.classes or []
    weights = {m.name: m.weight for m in info.models}
    shared = any(len(c.members) > 1 for c in classes)
    reserve = RESERVE if shared else 0.0
    member_ms = {}
    for c in classes:
        for model, region in c.members[1:]:
            problem = next(p for p in runs[model].problems() if p.name == region)
            member_ms[(model, region)] = weights.get(model, 1.0) * region_ms(problem)
    total_members = sum(member_ms.values()) or 1.0
    parts = {}
    for c in classes:
        parts[tuple(c.members[0])] = c.share * (1 - reserve)
        for key in map(tuple, c.members[1:]):
            parts[key] = reserve * member_ms[key] / total_members
    return parts


def model_rule(info: CorpusInfo, name: str, runs: dict[str, RunFolder], rule: StopRule) -> StopRule:
    """The stop rule `name`'s search runs under (module docstring)."""
    parts = _parts(info, runs)
    spent = {m: spent_seconds(run) for m, run in runs.items()}
    total = rule.gpu_hours * 3600.0
    mine = {key: part for key, part in parts.items() if key[0] == name}
    carry = 0.0
    for m in info.models:
        if m.name == name:
            break
        if m.state == "done" and m.name in runs:
            allotted = total * sum(part for key, part in parts.items() if key[0] == m.name)
            carry += max(0.0, allotted - spent[m.name])
    left = total - sum(s for m, s in spent.items() if m != name)
    cap = min(left, max(total * sum(mine.values()) + carry, FLOOR_SECONDS * len(mine)))
    members = sum(1 for c in info.classes or [] for model, _ in c.members[1:] if model == name)
    candidates = max(len(mine), round(rule.max_candidates * sum(mine.values()))) + SHARE_TOP * members
    usd = rule.max_usd * sum(mine.values()) if rule.max_usd else rule.max_usd
    return rule.model_copy(update={"gpu_hours": max(0.0, cap) / 3600.0, "max_candidates": max(1, candidates),
                                   "max_usd": usd})


def spent_seconds(run: RunFolder) -> float:
    """Device seconds the run's trials were charged."""
    if not run.check_store():
        return 0.0
    store = run.store(readonly=True)
    try:
        return sum(t.gpu_seconds for t in store.trials())
    finally:
        store.close()


def class_winners(run: RunFolder, region: str) -> list[Candidate]:
    """A finished leader's winners: its best `SHARE_TOP` candidates that passed, best first."""
    history = load_history(run, run.problems(), [])
    return [Candidate(region=region, source=(run.candidates_dir / f"{r.candidate_hash}.py").read_text(),
                      planner=r.planner, template=r.template, params=r.params)
            for r in history.kept(region)[:SHARE_TOP]]


def class_planner(info: CorpusInfo, name: str, runs: dict[str, RunFolder]) -> Callable[[Planner], Planner]:
    """What `name`'s search asks: its own planner for the classes it leads, and the leaders'
    winners first for the classes it is a member of (agent/planners/shared.py)."""
    shared = {}
    for c in info.classes or []:
        (leader_model, leader_region), rest = c.members[0], c.members[1:]
        for model, region in rest:
            if model != name:
                continue
            leader = f"{leader_model}/{leader_region}"
            shared[region] = Shared(leader, same_run=leader_region) if leader_model == name else \
                Shared(leader, winners=class_winners(runs[leader_model], leader_region))
    candidates_dir = runs[name].candidates_dir
    return (lambda planner: ClassPlanner(planner, shared, candidates_dir)) if shared else (lambda planner: planner)


def unique_names(stems: list[str]) -> list[str]:
    """A model's name in the corpus: its file's stem, with -2, -3 for a stem seen before."""
    seen: dict[str, int] = {}
    out = []
    for stem in stems:
        seen[stem] = seen.get(stem, 0) + 1
        out.append(stem if seen[stem] == 1 else f"{stem}-{seen[stem]}")
    return out

