"""The template planner (the default; needs no API key).

First every template whose signature fits the problem is tried, under every binding of the
region's tensors to the template's roles, at the template's default parameters: the
tolerance, not source matching, decides which of them compute the same function. Then the
parameter spaces of the (template, binding) arms that did not prove to compute another
function are searched by the shared genetic algorithm (`agent.planners.genetic`): fitness is
the speedup each kept candidate measured, children cross and mutate the best parameters, and
when draws stop finding new points the rest of the space is walked, so the planner has nothing
new only once its whole space is tried.

While the template's best for a region trails a baseline (the original, or the best
torch.compile candidate the compiler planner measured for that region), the spaces are widened
(`library.widen`: larger tiles, more warps, deeper pipelines), a level further each time a
widened space is exhausted, up to `library.MAX_WIDEN`; the search does not stop while it loses.
"""

from __future__ import annotations

import json
import random

from agent.history import CandidateRecord, History
from agent.planners.genetic import Measured, Space, evolve, seen_points
from agent.planners.library import MAX_WIDEN, KernelTemplate, TEMPLATES, applicable, default_params, render, widen
from agent.planners.llm import LLMCandidate, render_source
from tools.problem import Problem
from tools.trial import Candidate, Status

# Failures that say the template or binding computes another function: do not tune further.
DEAD = {Status.wrong, Status.shape, Status.nan, Status.hardcoded, Status.ignored_parameter, Status.mutated_input}
BASELINE_PLANNERS = ("compiler",)
"""Planners whose kept candidates are baselines the templates must beat (torch.compile)."""


def _arm(template: str, binding: dict) -> str:
    return template + json.dumps(binding, sort_keys=True, default=str)


def _swapped(a: dict, b: dict) -> bool:
    """Two bindings with the same roles and the same tensors, some of them in other roles."""
    if a == b or a.keys() != b.keys():
        return False
    differ = [k for k in a if a[k] != b[k]]
    return sorted(map(str, (a[k] for k in differ))) == sorted(map(str, (b[k] for k in differ)))


class TemplatePlanner:
    name = "template"

    def __init__(self, seed: int = 0, parents: int = 4, **_):
        self.seed = seed
        self.parents = parents

    def candidate(self, problem: Problem, t: KernelTemplate, binding: dict, params: dict,
                  parents: list[str] = ()) -> Candidate:
        return Candidate(region=problem.name, source=render(t, binding, params), planner=self.name,
                         template=t.name, params={"binding": binding, "tune": params}, parents=list(parents))

    def propose(self, problem: Problem, history: History, n: int) -> list[Candidate]:
        rng = random.Random(f"{self.seed}/{problem.name}/{len(history.trials)}")
        arms = {_arm(t.name, b): (t, b) for t, b in applicable(problem)}
        out: dict[str, Candidate] = {}

        def offer(c: Candidate) -> None:
            if c.hash not in out and not history.tried(problem.name, c.hash):
                out[c.hash] = c
        offer.seen = out

        waiting = self._alternates_waiting(problem, history, arms)
        for a, (t, b) in arms.items():  # exploration: every fitting template and binding, default point
            if len(out) >= n:
                break
            if a not in waiting:
                offer(self.candidate(problem, t, b, default_params(t)))
        self._retune_llm_kernels(problem, history, rng, (n - len(out) + 1) // 2, offer)
        records = self._records(problem, history, arms)
        judged = {self._arm_of(r) for r in records if self._finished(history, r)}
        # An arm is searched once its default has been judged: it may compute another function.
        spaces = {a: s for a, s in self.spaces(problem, history).items() if a in judged}
        gens = history.targets(problem.name)
        measured = [Measured(self._arm_of(r), r.params.get("tune", {}), r.score(gens), r.candidate_hash)
                    for r in records]
        known = {(self._arm_of(r), spaces[self._arm_of(r)].key(r.params.get("tune", {}))): r.candidate_hash
                 for r in records if self._arm_of(r) in spaces}
        made: dict[tuple, Candidate] = {}

        def is_new(arm: str, params: dict) -> bool:
            key = (arm, spaces[arm].key(params))
            if key in known:  # measured already: no need to render it to know
                return not history.tried(problem.name, known[key])
            t, b = arms[arm]
            made[key] = c = self.candidate(problem, t, b, params)
            return c.hash not in out and not history.tried(problem.name, c.hash)

        for child in evolve(spaces, measured, is_new, n - len(out), rng, self.parents):
            c = made[(child.arm, spaces[child.arm].key(child.params))]
            offer(c.model_copy(update={"parents": list(child.parents)}))
        return list(out.values())[:n]

    # -- the space ---------------------------------------------------------------------------
    def spaces(self, problem: Problem, history: History) -> dict[str, Space]:
        """The arms still worth searching, each with its space at the current widening level."""
        arms = {_arm(t.name, b): (t, b) for t, b in applicable(problem)}
        live = self._live(problem, history, arms)
        level = self.widening(problem, history, {a: arms[a] for a in live})
        return {a: Space.of(widen(arms[a][0].space, level), arms[a][0].fits) for a in live}

    def widening(self, problem: Problem, history: History, live: dict) -> int:
        """0 while the template's best keeps up with the baselines (or nothing is measured yet);
        else the first level whose widened space is not yet exhausted (at most `MAX_WIDEN`)."""
        gens = history.targets(problem.name)
        kept = history.kept(problem.name)
        mine = [r.score(gens) for r in kept if r.template in TEMPLATES]
        finished = [r for r in self._records(problem, history, live) if self._finished(history, r)]
        baseline = max([1.0] + [r.score(gens) for r in kept if r.planner in BASELINE_PLANNERS])
        if not finished or max(mine, default=0.0) >= baseline:
            return 0
        for level in range(1, MAX_WIDEN):
            tried, size = self._count(problem, history, live, level)
            if tried < size:
                return level
        return MAX_WIDEN

    def coverage(self, problem: Problem, history: History) -> tuple[int, int]:
        """(candidates of the space tried, the space's size). An arm that proved to compute
        another function counts as the points it was tried at: it is not searched further."""
        arms = {_arm(t.name, b): (t, b) for t, b in applicable(problem)}
        live = {a: arms[a] for a in self._live(problem, history, arms)}
        tried, size = self._count(problem, history, live, self.widening(problem, history, live))
        dead = [r for r in self._records(problem, history, arms) if self._arm_of(r) not in live
                and self._finished(history, r)]
        return tried + len(dead), size + len(dead)

    def space_size(self, problem: Problem, history: History | None = None) -> int:
        return self.coverage(problem, history or History())[1]

    def _count(self, problem: Problem, history: History, live: dict, level: int) -> tuple[int, int]:
        records = [r for r in self._records(problem, history, live) if self._finished(history, r)]
        tried = size = 0
        for a, (t, _) in live.items():
            space = Space.of(widen(t.space, level), t.fits)
            size += space.size()
            tried += seen_points(space, [r.params.get("tune", {}) for r in records if self._arm_of(r) == a])
        return tried, size

    def _live(self, problem: Problem, history: History, arms: dict) -> list[str]:
        """Arms not shown to compute another function (a kept candidate outweighs a failure), but
        swaps of an earlier arm's tensors still waiting on it."""
        records = self._records(problem, history, arms)
        gens = history.targets(problem.name)
        kept = {self._arm_of(r) for r in records if r.kept(gens)}
        dead = {self._arm_of(r) for r in records if (f := r.failed()) is not None and f.status in DEAD} - kept
        waiting = self._alternates_waiting(problem, history, arms)
        return [a for a in arms if a not in dead and a not in waiting]

    def _alternates_waiting(self, problem: Problem, history: History, arms: dict) -> set[str]:
        """Arms that only swap an earlier arm's tensors between roles (a K and a V projection of
        the same shape): tried once every earlier such arm of the template computed another
        function. Where one passed, its swaps compute another function unless the swapped
        tensors are equal (each cost the H200's short tunes one trial in five, `wrong`)."""
        records = self._records(problem, history, arms)
        dead = {self._arm_of(r) for r in records if (f := r.failed()) is not None and f.status in DEAD}
        waiting, order = set(), list(arms)
        for i, a in enumerate(order):
            t, b = arms[a]
            earlier = [e for e in order[:i] if arms[e][0].name == t.name and _swapped(arms[e][1], b)]
            if any(e not in dead for e in earlier):
                waiting.add(a)
        return waiting

    def _records(self, problem: Problem, history: History, arms: dict) -> list[CandidateRecord]:
        return [r for r in history.region_records(problem.name) if r.template in TEMPLATES
                and r.planner == self.name and self._arm_of(r) in arms]

    @staticmethod
    def _finished(history: History, r: CandidateRecord) -> bool:
        return all(history.done(r.region, r.candidate_hash, g) for g in history.targets(r.region))

    @staticmethod
    def _arm_of(r: CandidateRecord) -> str:
        return _arm(r.template or "", r.params.get("binding", {}))

    @staticmethod
    def _pick(parents: list[CandidateRecord], rng: random.Random) -> CandidateRecord:
        """Rank-weighted choice: the best parent is picked most often."""
        weights = [1.0 / (i + 1) for i in range(len(parents))]
        return rng.choices(parents, weights=weights)[0]

    def _retune_llm_kernels(self, problem: Problem, history: History, rng: random.Random, room: int,
                            offer) -> None:
        """Kept LLM-written kernels that declared tunables get their parameters searched too."""
        parents = [r for r in history.kept(problem.name) if r.params.get("template_source") and
                   r.params.get("tunables")][: self.parents]
        for _ in range(4 * room):
            if not parents or room <= 0:
                return
            p = self._pick(parents, rng)
            space = {k: tuple(v) for k, v in p.params["tunables"].items() if v}
            tune = Space.of(space).mutate(p.params.get("tune", {}), rng)
            try:
                source = render_source(LLMCandidate(source=p.params["template_source"], tunables=space), tune)
            except Exception:  # placeholders the kernel's author got wrong: nothing to tune
                return
            before = len(offer.seen)
            offer(Candidate(region=problem.name, source=source, planner=self.name,
                            template=f"{p.planner}:{p.candidate_hash}",
                            params={**p.params, "tune": tune}, parents=[p.candidate_hash]))
            room -= len(offer.seen) - before
