"""A corpus run: many model files tuned in one night, each distinct problem searched once.

    runs/<corpus-id>/corpus.json       the models (file, weight, run folder, state), the problem
                                       classes, the settings (tools/classes.py groups the classes)
    runs/<corpus-id>/models/<run>/     one ordinary run folder per model (agent status, report,
                                       integrate and apply work on it as on any run)
    runs/<corpus-id>/log.txt           the corpus's own progress lines
    runs/<corpus-id>/report.md, .html  one row per model, one per problem class, the totals

corpus.json is rewritten whole (through a temporary file) after every step, so a kill at any
moment leaves the last step's state; each model's trials are in its own run's store.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from tools import strict_json
from tools.problem import ProblemError
from tools.runfolder import RunFolder, RunLock, check_runs_dir

CORPUS_FILE = "corpus.json"


class CorpusModel(BaseModel):
    name: str
    """Its name in the corpus: the file's stem (with -2, -3 for a stem seen before)."""
    file: str
    weight: float = 1.0
    """How much its time counts in the corpus's split of the budget (--model-weight NAME=W)."""
    run: str = ""
    """Its run folder under models/, once profiled and frozen."""
    state: Literal["pending", "frozen", "failed", "done"] = "pending"
    """pending: not frozen yet; frozen: its search (and integration) to do; done: searched and
    integrated (or said why not) under `cap_hours`; failed: it could not be profiled or frozen."""
    reason: str = ""
    """Why it failed, or why it was not integrated."""
    cap_hours: float | None = None
    """The device-hours cap its last finished search ran under (a resume with another cap searches again)."""


class ClassRecord(BaseModel):
    key: str
    members: list[tuple[str, str]]
    """(model, region), the leader first."""
    share: float = 0.0
    """Its part of the corpus's frozen time (weighted by model)."""


class CorpusInfo(BaseModel):
    corpus_id: str
    created_at: float = Field(default_factory=time.time)
    models: list[CorpusModel]
    classes: list[ClassRecord] | None = None
    """None until every model was frozen (or failed), then fixed for the run's life."""
    options: dict = Field(default_factory=dict)
    """The tune settings and request options, for --resume."""


def is_corpus(path: Path) -> bool:
    return (Path(path) / CORPUS_FILE).is_file()


class CorpusFolder:
    def __init__(self, path: Path):
        self.path = Path(path)

    @classmethod
    def create(cls, runs_dir: Path, info_models: list[CorpusModel], options: dict) -> "CorpusFolder":
        check_runs_dir(runs_dir)
        base = Path(runs_dir) / f"corpus-{time.strftime('%Y%m%d-%H%M%S')}"
        path, i = base, 2
        while path.exists():
            path, i = Path(f"{base}-{i}"), i + 1
        try:
            (path / "models").mkdir(parents=True)
        except OSError as e:
            raise ProblemError(f"--runs-dir {runs_dir}: cannot create {path} ({e.strerror})") from None
        folder = cls(path)
        folder.write(CorpusInfo(corpus_id=path.name, models=info_models, options=options))
        return folder

    @classmethod
    def open(cls, path: Path) -> "CorpusFolder":
        folder = cls(path)
        if not is_corpus(folder.path):
            raise ProblemError(f"{path}: not a corpus run (no {CORPUS_FILE})")
        folder.info()
        return folder

    @property
    def models_dir(self) -> Path:
        return self.path / "models"

    @property
    def log_path(self) -> Path:
        return self.path / "log.txt"

    def info(self) -> CorpusInfo:
        path = self.path / CORPUS_FILE
        try:
            return CorpusInfo.model_validate_json(path.read_text())
        except (ValueError, OSError) as e:
            why = " ".join(str(e).strip().splitlines()[:3]) or type(e).__name__
            raise ProblemError(f"{path} is not a valid corpus description ({why}); restore it, or start the "
                               "corpus again") from None

    def write(self, info: CorpusInfo) -> None:
        tmp = self.path / (CORPUS_FILE + ".tmp")
        tmp.write_text(strict_json.dumps(info, indent=2))
        tmp.replace(self.path / CORPUS_FILE)

    def run_of(self, model: CorpusModel) -> RunFolder | None:
        return RunFolder.open(self.models_dir / model.run) if model.run else None

    def runs(self) -> dict[str, RunFolder]:
        """Model name -> its run folder, for every model frozen."""
        return {m.name: RunFolder.open(self.models_dir / m.run) for m in self.info().models if m.run}

    def lock(self) -> RunLock:
        return RunLock(self.path / "tune.lock")

    def log(self, line: str) -> None:
        with self.log_path.open("a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
