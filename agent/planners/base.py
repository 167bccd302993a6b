"""What every planner is, and the few things planners share: the protocol, the error for a
planner that cannot work as configured, and several planners sharing one round."""

from __future__ import annotations

import traceback
from typing import Callable, Protocol

from agent.history import History
from tools.problem import Problem
from tools.trial import Candidate


class Planner(Protocol):
    name: str

    def propose(self, problem: Problem, history: History, n: int) -> list[Candidate]:
        """Up to n new candidates for `problem`, given everything tried so far (and what is
        queued or running, `history.pending`). Nothing new is an answer, not an end: the loop
        asks again once more results are in."""
        ...

    # Planners with a finite space (template, compiler) also have
    #     coverage(problem, history) -> (candidates of the space tried, the space's size)
    # so that a search that ends because nothing is new says how much of the space that was.


class PlannerError(Exception):
    """A planner that cannot work as configured (e.g. a missing API key); says how to fix it."""


class PlannerFailed(Exception):
    """A planner raised while proposing: a bug, not a verdict. Carries what it raised."""

    def __init__(self, planner: str, error: BaseException):
        self.planner = planner
        self.detail = "".join(traceback.format_exception(type(error), error, error.__traceback__))[-4000:]
        super().__init__(f"planner {planner} failed: {type(error).__name__}: {error}")


class Combined:
    """Several planners share each round; each gets a fair part of the batch. A planner that
    raises is set aside (and said so through `on_failure`) while the others go on; when every
    one has failed, the last failure is raised."""

    def __init__(self, planners: list[Planner], on_failure: Callable[[PlannerFailed], None] = lambda e: None):
        self.planners = planners
        self.name = ",".join(p.name for p in planners)
        self.failed: dict[str, PlannerFailed] = {}
        self.on_failure = on_failure

    def propose(self, problem: Problem, history: History, n: int) -> list[Candidate]:
        out: list[Candidate] = []
        live = [p for p in self.planners if p.name not in self.failed]
        share = max(1, n // max(1, len(live)))
        for p in live:
            out += self._ask(p, problem, history, share)
        self._raise_if_all_failed(live)
        return out

    def _ask(self, p: Planner, problem: Problem, history: History, n: int) -> list[Candidate]:
        try:
            return p.propose(problem, history, n)
        except Exception as e:  # noqa: BLE001 - one planner's bug must not end the others' night
            self.failed[p.name] = PlannerFailed(p.name, e)
            self.on_failure(self.failed[p.name])
            return []

    def _raise_if_all_failed(self, live: list[Planner]) -> None:
        if len(self.failed) == len(self.planners):
            raise self.failed[live[-1].name] if live else next(iter(self.failed.values()))


class Fallback(Combined):
    """The first planner; the next one only for a region the first has nothing new for right now
    (no template fits it, every fit was spent or proved to compute something else, or all of its
    points are in flight). The default, `auto`: templates, then torch.compile's candidates, so a
    region no template fits (a KernelBench level-2 chain, a convolution) is still searched, and a
    GPU whose templates have run dry keeps working."""

    def __init__(self, planners: list[Planner], on_failure: Callable[[PlannerFailed], None] = lambda e: None,
                 name: str = "auto"):
        super().__init__(planners, on_failure)
        self.name = name

    def propose(self, problem: Problem, history: History, n: int) -> list[Candidate]:
        live = [p for p in self.planners if p.name not in self.failed]
        for p in live:
            if got := self._ask(p, problem, history, n):
                return got
        self._raise_if_all_failed(live)
        return []

    def coverage(self, problem: Problem, history: History) -> tuple[int, int]:
        """(candidates tried, size) over its planners' spaces together."""
        parts = [p.coverage(problem, history) for p in self.planners]
        return sum(t for t, _ in parts), sum(s for _, s in parts)
