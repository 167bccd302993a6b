"""The files planner: candidates that an outside agent (Claude Code, Codex, a person) drops
into `runs/<run>/inbox/<Region>/*.py` are picked up, so long runs still use the budget, the
parallel workers and the store."""

from __future__ import annotations

from pathlib import Path

from agent.history import History
from tools.problem import Problem
from tools.trial import Candidate


class FilesPlanner:
    name = "files"

    def __init__(self, inbox: Path | None = None, **_):
        self.inbox = Path(inbox) if inbox else None

    def propose(self, problem: Problem, history: History, n: int) -> list[Candidate]:
        if self.inbox is None or not (self.inbox / problem.name).is_dir():
            return []
        out = []
        for path in sorted((self.inbox / problem.name).glob("*.py")):
            c = Candidate(region=problem.name, source=path.read_text(), planner="files", note=path.name)
            if not history.tried(problem.name, c.hash):
                out.append(c)
            if len(out) >= n:
                break
        return out
