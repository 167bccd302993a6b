"""A run is a self-describing folder: what was profiled, frozen, tried and found.

    runs/<run-id>/run.json          model, hashes, devices, versions, options
    runs/<run-id>/hotspots.json     the profile;  trace.json  its Chrome trace
    runs/<run-id>/problems/<name>/  frozen problems (see tools.problem)
    runs/<run-id>/candidates/       every candidate's source, by hash
    runs/<run-id>/trials.sqlite     every finished trial (see tools.store)
    runs/<run-id>/inbox/            candidates dropped in by an outside agent (files planner)
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from tools.problem import Problem, ProblemError
from tools.store import Store


class RunInfo(BaseModel):
    run_id: str
    model_file: str
    model_hash: str
    device: str
    created_at: float = Field(default_factory=time.time)
    versions: dict[str, str] = Field(default_factory=dict)
    options: dict[str, Any] = Field(default_factory=dict)
    """What the run was started with (budget, planner, devices, ...), for --resume."""
    skipped: dict[str, str] = Field(default_factory=dict)
    """Regions that were not frozen, and why."""


class RunFolder:
    def __init__(self, path: Path):
        self.path = Path(path)

    @classmethod
    def create(cls, runs_dir: Path, model_file: Path) -> "RunFolder":
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = Path(runs_dir) / f"{Path(model_file).stem}-{stamp}"
        path, i = base, 2
        while path.exists():
            path, i = Path(f"{base}-{i}"), i + 1
        path.mkdir(parents=True)
        return cls(path)

    @classmethod
    def open(cls, path: Path) -> "RunFolder":
        path = Path(path)
        if not (path / "run.json").is_file():
            raise ProblemError(f"{path}: not a run folder (no run.json)")
        return cls(path)

    @property
    def run_id(self) -> str:
        return self.path.name

    @property
    def problems_dir(self) -> Path:
        return self.path / "problems"

    @property
    def candidates_dir(self) -> Path:
        return self.path / "candidates"

    @property
    def inbox(self) -> Path:
        return self.path / "inbox"

    def info(self) -> RunInfo:
        return RunInfo.model_validate_json((self.path / "run.json").read_text())

    def write_info(self, info: RunInfo) -> None:
        tmp = self.path / "run.json.tmp"
        tmp.write_text(info.model_dump_json(indent=2))
        tmp.replace(self.path / "run.json")

    def problems(self) -> list[Problem]:
        if not self.problems_dir.is_dir():
            return []
        return [Problem.load(p) for p in sorted(self.problems_dir.iterdir()) if (p / "problem.json").is_file()]

    def store(self, readonly: bool = False) -> Store:
        return Store(self.path / "trials.sqlite", readonly=readonly)

    def save_candidate(self, source: str, digest: str) -> Path:
        self.candidates_dir.mkdir(exist_ok=True)
        path = self.candidates_dir / f"{digest}.py"
        if not path.exists():
            path.write_text(source)
        return path
