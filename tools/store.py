"""The run's store: every finished trial on disk at once, in SQLite with a write-ahead log.

Only the tuner process writes. Each trial is committed in its own transaction as soon as it
finishes, so a kill -9 loses at most the trials that were still running. Readers (`agent
status`, `agent report`) can open the database while a run writes to it.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Iterator

from tools.trial import Trial

SCHEMA = """
CREATE TABLE IF NOT EXISTS trials (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    region TEXT NOT NULL,
    candidate_hash TEXT NOT NULL,
    candidate_path TEXT,
    planner TEXT,
    template TEXT,
    status TEXT NOT NULL,
    reason TEXT,
    error REAL,
    max_abs REAL,
    max_rel REAL,
    tolerance TEXT,
    speedup REAL,
    device TEXT,
    device_name TEXT,
    generation TEXT,
    gpu_seconds REAL,
    started_at REAL,
    finished_at REAL,
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS trials_key ON trials (region, candidate_hash, generation);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    kind TEXT NOT NULL,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS llm_calls (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    provider TEXT NOT NULL,
    model TEXT NOT NULL,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    usd REAL NOT NULL,
    seconds REAL,
    attempts INTEGER,
    ok INTEGER NOT NULL,
    error TEXT,
    purpose TEXT
);
"""


class Store:
    def __init__(self, path: Path, readonly: bool = False):
        self.path = Path(path)
        if readonly:
            self.db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=30)
        else:
            self.db = sqlite3.connect(self.path, timeout=30)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.executescript(SCHEMA)

    def record(self, trial: Trial) -> None:
        with self.db:
            self.db.execute(
                "INSERT INTO trials (region, candidate_hash, candidate_path, planner, template, status, reason,"
                " error, max_abs, max_rel, tolerance, speedup, device, device_name, generation, gpu_seconds,"
                " started_at, finished_at, body) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (trial.region, trial.candidate_hash, trial.candidate_path, trial.planner, trial.template,
                 trial.status.value, trial.reason, trial.error, trial.max_abs, trial.max_rel, trial.tolerance,
                 trial.speedup, trial.device, trial.device_name, trial.generation, trial.gpu_seconds,
                 trial.started_at, trial.finished_at, trial.model_dump_json()))

    def event(self, kind: str, **body) -> None:
        with self.db:
            self.db.execute("INSERT INTO events (at, kind, body) VALUES (?,?,?)",
                            (time.time(), kind, json.dumps(body)))

    def record_llm_call(self, call, purpose: str = "") -> None:
        """One LLM request, answered or failed for good: `call` is an `agent.llm.Reply`, an
        `agent.llm.LLMError`, or a dict of the table's columns."""
        failed = isinstance(call, BaseException)
        get = call.get if isinstance(call, dict) else lambda name, default=None: getattr(call, name, default)
        with self.db:
            self.db.execute(
                "INSERT INTO llm_calls (at, provider, model, input_tokens, output_tokens, usd, seconds, attempts,"
                " ok, error, purpose) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (time.time(), get("provider", ""), get("model", ""), get("input_tokens", 0) or 0,
                 get("output_tokens", 0) or 0, get("usd", 0.0) or 0.0, get("seconds"), get("attempts"),
                 int(not failed and get("ok", True)), str(call) if failed else get("error"),
                 purpose or get("purpose")))

    def llm_usd(self) -> float:
        """USD spent on LLM calls so far (0 for a run from before the table existed)."""
        try:
            return float(self.db.execute("SELECT COALESCE(SUM(usd), 0) FROM llm_calls").fetchone()[0])
        except sqlite3.OperationalError:  # opened read-only, older schema
            return 0.0

    def trials(self, region: str | None = None) -> Iterator[Trial]:
        q, args = "SELECT body FROM trials", ()
        if region is not None:
            q, args = q + " WHERE region = ?", (region,)
        for (body,) in self.db.execute(q + " ORDER BY id", args):
            yield Trial.model_validate_json(body)

    def gpu_seconds(self) -> float:
        return float(self.db.execute("SELECT COALESCE(SUM(gpu_seconds), 0) FROM trials").fetchone()[0])

    def count(self) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM trials").fetchone()[0])

    def close(self) -> None:
        self.db.close()
