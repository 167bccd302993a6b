"""The template planner (the default; needs no API key).

Round one tries every template whose signature fits the problem, under every binding of the
region's tensors to the template's roles, at the template's default parameters: the
tolerance, not source matching, decides which of them compute the same function. Later
rounds search the parameter spaces of the survivors with a small evolutionary step: the
best kept candidates are parents, children change one or two parameters to a neighbouring
value (or a random one), and pairs of parents of the same template are crossed.
"""

from __future__ import annotations

import json
import random

from agent.history import CandidateRecord, History
from agent.planners.library import KernelTemplate, TEMPLATES, applicable, default_params, render
from agent.planners.llm import LLMCandidate, render_source
from tools.problem import Problem
from tools.trial import Candidate, Status

# Failures that say the template or binding computes another function: do not tune further.
DEAD = {Status.wrong, Status.shape, Status.nan, Status.hardcoded, Status.mutated_input}


def _arm(template: str, binding: dict) -> str:
    return template + json.dumps(binding, sort_keys=True, default=str)


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

        for t, b in arms.values():  # exploration: every fitting template and binding, default point
            if len(out) >= n:
                break
            offer(self.candidate(problem, t, b, default_params(t)))
        self._retune_llm_kernels(problem, history, rng, (n - len(out) + 1) // 2, offer)
        records = [r for r in history.region_records(problem.name) if r.template in TEMPLATES]
        dead = {self._arm_of(r) for r in records if (f := r.failed()) is not None and f.status in DEAD}
        kept = [r for r in history.kept(problem.name) if r.template in TEMPLATES and self._arm_of(r) in arms]
        parents = kept[: self.parents]
        # Arms whose default only failed to compile or ran out of resources get random points.
        retry = [a for a in {self._arm_of(r) for r in records} - dead - {self._arm_of(r) for r in kept} if a in arms]
        for _ in range(20 * n):
            if len(out) >= n:
                break
            if parents and (not retry or rng.random() < 0.8):
                p = self._pick(parents, rng)
                t, b = arms[self._arm_of(p)]
                params = dict(p.params.get("tune", {}))
                mates = [q for q in parents if self._arm_of(q) == self._arm_of(p) and q is not p]
                if mates and rng.random() < 0.3:
                    other = rng.choice(mates).params.get("tune", {})
                    params = {k: rng.choice([params.get(k), other.get(k)]) for k in t.space}
                params = self._mutate(t.space, params, rng)
                if t.fits(params):
                    offer(self.candidate(problem, t, b, params, [p.candidate_hash]))
            elif retry:
                t, b = arms[rng.choice(retry)]
                offer(self.candidate(problem, t, b, t.sample(rng)))
            else:
                break
        return list(out.values())[:n]

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
            tune = self._mutate(space, p.params.get("tune", {}), rng)
            try:
                source = render_source(LLMCandidate(source=p.params["template_source"], tunables=space), tune)
            except Exception:  # placeholders the kernel's author got wrong: nothing to tune
                return
            before = len(offer.seen)
            offer(Candidate(region=problem.name, source=source, planner=self.name,
                            template=f"{p.planner}:{p.candidate_hash}",
                            params={**p.params, "tune": tune}, parents=[p.candidate_hash]))
            room -= len(offer.seen) - before

    @staticmethod
    def _mutate(space: dict[str, tuple], params: dict, rng: random.Random) -> dict:
        params = {k: params.get(k, v[0]) for k, v in space.items()}
        keys = [k for k, v in space.items() if len(v) > 1]
        for k in rng.sample(keys, min(len(keys), rng.choice((1, 1, 2)))):
            raw = list(space[k])
            values = sorted(raw) if all(isinstance(v, (int, float)) for v in raw) else raw
            i = values.index(params[k]) if params[k] in values else 0
            if rng.random() < 0.7:  # a neighbouring value: most gains are local
                i = max(0, min(len(values) - 1, i + rng.choice((-1, 1))))
            else:
                i = rng.randrange(len(values))
            params[k] = values[i]
        return params
