"""Planners propose candidates; they are chosen by name (`--planner template,anthropic`)."""

from __future__ import annotations

from typing import Protocol

from agent.history import History
from tools.problem import Problem
from tools.trial import Candidate


class Planner(Protocol):
    name: str

    def propose(self, problem: Problem, history: History, n: int) -> list[Candidate]:
        """Up to n new candidates for `problem`, given everything tried so far."""
        ...


class PlannerError(Exception):
    """A planner that cannot work as configured (e.g. a missing API key); says how to fix it."""


def make_planner(spec: str, **options) -> Planner:
    """`template`, `files`, `anthropic`, `openai`, or several joined by commas. LLM planners
    need their API key; a missing key is an error, never a silent switch to another planner."""
    from agent.planners.files import FilesPlanner
    from agent.planners.template import TemplatePlanner

    def llm(provider: str):
        def build(**opts):
            from agent.llm import make_client
            from agent.planners.llm import LLMPlanner
            client = make_client(provider, model=opts.get("llm_model"), base_url=opts.get("base_url"))
            return LLMPlanner(client, **opts)
        return build

    table = {"template": TemplatePlanner, "files": FilesPlanner, "anthropic": llm("anthropic"),
             "openai": llm("openai")}
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in table]
    if not names or unknown:
        raise PlannerError(f"unknown planner {', '.join(unknown) or spec!r}: choose from {', '.join(table)}")
    planners = [table[n](**options) for n in names]
    return planners[0] if len(planners) == 1 else Combined(planners)


class Combined:
    """Several planners share each round; each gets a fair part of the batch."""

    def __init__(self, planners: list[Planner]):
        self.planners = planners
        self.name = ",".join(p.name for p in planners)

    def propose(self, problem: Problem, history: History, n: int) -> list[Candidate]:
        out: list[Candidate] = []
        share = max(1, n // len(self.planners))
        for p in self.planners:
            out += p.propose(problem, history, share)
        return out
