"""The run's store: every finished trial on disk at once, in SQLite with a write-ahead log.

Only the tuner process writes (its threads share one connection, writes serialized). Each
trial is committed in its own transaction as soon as it finishes, so a kill -9 loses at most
the trials that were still running; a `start` event is written when a trial starts, so a
trial the tuner died in is known on resume. Readers (`agent status`, `agent report`) can open
the database while a run writes to it. A file that is not a readable store is a `StoreError`
naming it, never a traceback and never a silent new store.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Iterator

from pydantic import ValidationError

from tools import strict_json
from tools.trial import Trial


class StoreError(Exception):
    """The trials store cannot be read or written; the message names the file."""

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
        self.lock = threading.Lock()
        if self.path.is_dir():
            raise StoreError(f"{self.path} is a directory, not a trial store")
        try:
            if readonly:
                self.db = self._open_readonly()
            else:
                self.db = sqlite3.connect(self.path, timeout=30, check_same_thread=False)
                self.db.execute("PRAGMA journal_mode=WAL")
                self.db.execute("PRAGMA synchronous=NORMAL")
                self.db.executescript(SCHEMA)
        except sqlite3.Error as e:
            raise StoreError(f"{self.path} cannot be opened as a trial store ({e})") from None

    def _open_readonly(self) -> sqlite3.Connection:
        """A reader's connection. A WAL store in a folder we cannot write (a read-only mount, a
        copy on a share) cannot get its -shm file; nothing can be writing it there either, so
        it is read as immutable rather than called damaged."""
        uri = self.path.resolve().as_uri()
        try:
            db = sqlite3.connect(f"{uri}?mode=ro", uri=True, timeout=30, check_same_thread=False)
            db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
            return db
        except sqlite3.OperationalError:
            if os.access(self.path.parent, os.W_OK):
                raise
        db = sqlite3.connect(f"{uri}?mode=ro&immutable=1", uri=True, timeout=30, check_same_thread=False)
        db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
        return db

    def blank(self) -> bool:
        """No table at all: made, but its schema never written (the disk filled as it was made)."""
        try:
            return self.db.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchone() is None
        except sqlite3.Error:
            return False

    def check(self) -> None:
        """Raise StoreError unless the whole file reads as a trial store (a truncated or
        overwritten file often opens fine and fails only on the page it lost)."""
        try:
            problems = [r[0] for r in self.db.execute("PRAGMA quick_check").fetchall()]
            tables = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        except sqlite3.Error as e:
            raise StoreError(f"{self.path} is damaged ({e})") from None
        if problems != ["ok"]:
            raise StoreError(f"{self.path} is damaged ({'; '.join(problems[:2])})")
        if "trials" not in tables:
            raise StoreError(f"{self.path} is an SQLite file but not a trial store (no trials table)")

    def _write(self, sql: str, args: tuple) -> None:
        try:
            with self.lock, self.db:
                self.db.execute(sql, args)
        except sqlite3.Error as e:
            raise StoreError(f"{self.path}: cannot write ({e})") from None

    def record(self, trial: Trial) -> None:
        self._write(
            "INSERT INTO trials (region, candidate_hash, candidate_path, planner, template, status, reason,"
            " error, max_abs, max_rel, tolerance, speedup, device, device_name, generation, gpu_seconds,"
            " started_at, finished_at, body) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (trial.region, trial.candidate_hash, trial.candidate_path, trial.planner, trial.template,
             trial.status.value, trial.reason, trial.error, trial.max_abs, trial.max_rel, trial.tolerance,
             trial.speedup, trial.device, trial.device_name, trial.generation, trial.gpu_seconds,
             trial.started_at, trial.finished_at, strict_json.dumps(trial)))

    def event(self, kind: str, **body) -> None:
        self._write("INSERT INTO events (at, kind, body) VALUES (?,?,?)", (time.time(), kind, strict_json.dumps(body)))

    def events(self, kind: str) -> list[dict]:
        rows = self._read("SELECT body FROM events WHERE kind = ? ORDER BY id", (kind,))
        return [json.loads(b) for (b,) in rows]

    def last_event(self, kind: str) -> dict | None:
        rows = self._read("SELECT body FROM events WHERE kind = ? ORDER BY id DESC LIMIT 1", (kind,))
        return json.loads(rows[0][0]) if rows else None

    def ended_cleanly(self) -> bool:
        """Every session of the loop that began (a `session` event) wrote its `stop` event."""
        rows = self._read("SELECT COALESCE(MAX(CASE WHEN kind = 'session' THEN id END), 0), "
                          "COALESCE(MAX(CASE WHEN kind = 'stop' THEN id END), 0) FROM events", ())
        return not rows or rows[0][0] <= rows[0][1]

    def unfinished(self) -> dict[tuple[str, str, str], int]:
        """(region, candidate, generation) -> how often a trial of it started and never ended:
        no trial recorded, and not cancelled by a clean stop (the tuner died while it ran)."""
        counts: dict[tuple[str, str, str], int] = {}
        for kind, sign in (("start", 1), ("cancel", -1)):
            for e in self.events(kind):
                key = (e.get("region", ""), e.get("candidate", ""), e.get("generation", ""))
                counts[key] = counts.get(key, 0) + sign
        ended = {(r, c, g): n for r, c, g, n in self._read(
            "SELECT region, candidate_hash, generation, COUNT(*) FROM trials GROUP BY region, candidate_hash, generation",
            ())}
        return {k: n - ended.get(k, 0) for k, n in counts.items() if n - ended.get(k, 0) > 0}

    def _read(self, sql: str, args: tuple) -> list[tuple]:
        try:
            with self.lock:
                return self.db.execute(sql, args).fetchall()
        except sqlite3.OperationalError as e:
            if "no such table" in str(e):
                return []
            raise StoreError(f"{self.path} cannot be read ({e})") from None
        except sqlite3.Error as e:
            raise StoreError(f"{self.path} cannot be read ({e})") from None

    def record_llm_call(self, call, purpose: str = "") -> None:
        """One LLM request, answered or failed for good: `call` is an `agent.planners.llm_client.Reply`, an
        `agent.planners.llm_client.LLMError`, or a dict of the table's columns."""
        failed = isinstance(call, BaseException)
        get = call.get if isinstance(call, dict) else lambda name, default=None: getattr(call, name, default)
        self._write(
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
        q, args = "SELECT id, body FROM trials", ()
        if region is not None:
            q, args = q + " WHERE region = ?", (region,)
        for row_id, body in self._read(q + " ORDER BY id", args):
            try:
                yield Trial.model_validate_json(body)
            except (ValidationError, ValueError) as e:
                raise StoreError(f"{self.path}: trial row {row_id} cannot be read ({str(e).splitlines()[0]})") \
                    from None

    def gpu_seconds(self) -> float:
        return float(self._read("SELECT COALESCE(SUM(gpu_seconds), 0) FROM trials", ())[0][0])

    def count(self) -> int:
        rows = self._read("SELECT COUNT(*) FROM trials", ())
        return int(rows[0][0]) if rows else 0

    def close(self) -> None:
        self.db.close()
