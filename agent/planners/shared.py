"""The class planner of a corpus run: a problem class is searched once, on its leader.

Around the run's own planner (`search`): a region that leads its class, or is alone in it, is
searched by `search`. A member of a class led elsewhere first gets the leader's winners (its best
`SHARE_TOP` passing candidates), each verified and timed on the member's own frozen problem like
any candidate (its weights and references are its own); the winner counts there only if it
passes there. A member on which every winner failed is searched on its own by `search`. A class
whose leader found no winner is not searched again on its members.

A shared candidate keeps its planner and template (the jail's rules for LLM code still hold)
and carries `params["class_winner"]`: the leader it came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from agent.history import History
from agent.planners.base import Planner
from tools.problem import Problem
from tools.trial import Candidate

SHARE_TOP = 3
"""A leader's winners verified on each member: its best passing candidates, best first."""
CLASS_WINNER = "class_winner"
"""The params key of a shared candidate: `<model>/<region>` of the leader it won on."""


@dataclass
class Shared:
    """Where a member's winners come from."""

    leader: str
    """`<model>/<region>` of the class's leader."""
    winners: list[Candidate] = field(default_factory=list)
    """The leader's winners, best first, when the leader is in another model's (finished) run."""
    same_run: str | None = None
    """Or the leader's region in this run: its winners are read from the history as it grows."""


class ClassPlanner:
    def __init__(self, search: Planner, shared: dict[str, Shared], candidates_dir: Path):
        self.search, self.shared, self.candidates_dir = search, shared, Path(candidates_dir)
        self.name = search.name

    # what the loop reads of a planner that stopped (agent/search/loop.py)
    @property
    def failure(self) -> str:
        return getattr(self.search, "failure", "")

    @property
    def stopped(self) -> str:
        return getattr(self.search, "stopped", "")

    @property
    def failed(self) -> dict:
        return getattr(self.search, "failed", {})

    def winners(self, problem: Problem, history: History) -> list[Candidate]:
        """The class's winners as candidates for this member."""
        s = self.shared[problem.name]
        if s.same_run is None:
            base = s.winners
        else:
            base = [Candidate(region=s.same_run, source=(self.candidates_dir / f"{r.candidate_hash}.py").read_text(),
                              planner=r.planner, template=r.template, params=r.params)
                    for r in history.kept(s.same_run)[:SHARE_TOP]]
        return [c.model_copy(update={"region": problem.name, "params": {**c.params, CLASS_WINNER: s.leader}})
                for c in base]

    def state(self, problem: Problem, history: History) -> tuple[str, list[Candidate]]:
        """(`search`, []) for a region searched here: a leader, or a member every winner failed on;
        (`verifying`, the winners still to try); (`shared`, []) a winner passed here; (`no winner`,
        []) the leader found none."""
        if problem.name not in self.shared:
            return "search", []
        winners = self.winners(problem, history)
        if not winners:
            return "no winner", []
        todo = [c for c in winners if not history.tried(problem.name, c.hash)]
        if todo or any((problem.name, c.hash) in history.pending for c in winners):
            return "verifying", todo
        gens = history.targets(problem.name)
        kept = [c for c in winners if (rec := history.records.get((problem.name, c.hash))) and rec.kept(gens)]
        return ("shared", []) if kept else ("search", [])

    def propose(self, problem: Problem, history: History, n: int) -> list[Candidate]:
        state, todo = self.state(problem, history)
        if state == "search":
            return self.search.propose(problem, history, n)
        return todo[:max(1, n)]

    def coverage(self, problem: Problem, history: History) -> tuple[int, int]:
        state, todo = self.state(problem, history)
        if state == "search":
            cover = getattr(self.search, "coverage", None)
            return cover(problem, history) if cover else (0, 0)
        size = len(self.winners(problem, history))
        return size - len(todo), size
