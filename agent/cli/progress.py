"""What a person sees while a run goes, and what is left of it in the morning.

On a terminal: the live progress table (agent/cli/view.py). Without one (nohup, a pipe, a batch
job): one line per finished trial, and a line every `interval` seconds while none finishes,
each with the counts, the best so far and the budget left. The same lines, with the notes and
the start and stop of every session, always go to runs/<run>/log.txt, flushed as written.
Writing to a terminal that has gone away never stops the run.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, TextIO

from agent.history import History
from agent.cli.view import budget_line, progress_rows, progress_table
from agent.report.numbers import times
from tools.problem import Problem
from tools.trial import Trial

INTERVAL_S = 30.0


class Progress:
    def __init__(self, log_path: Path, problems: list[Problem], history: History, timing_kind: str,
                 max_candidates: int, gpu_hours: float, lines: TextIO | None = None, console=None,
                 interval: float = INTERVAL_S):
        """`lines`: the stream for line-oriented progress (None: the log file only); `console`:
        a rich Console for the live table (None: no live table)."""
        self.problems, self.history, self.kind = problems, history, timing_kind
        self.max_candidates, self.gpu_hours = max_candidates, gpu_hours
        self.lines, self.interval = lines, interval
        self.budget = None
        self.doing = ""
        """A long phase after the search (integration), said by the periodic line instead of the trials."""
        self.in_flight: Callable[[], list[str]] = lambda: []
        """What the running trials are doing ('LlamaMLP 8453f559 timing decode 3 s'), for the periodic line."""
        self.count = 0
        self.last_line = time.monotonic()
        self.lock = threading.Lock()
        self.closed = threading.Event()
        try:
            self.log: TextIO | None = open(log_path, "a", buffering=1)
        except OSError:
            self.log = None
        self.live = None
        if console is not None:
            from rich.live import Live
            self.live = Live(self.table(), console=console, refresh_per_second=2, transient=False)
        self.ticker = threading.Thread(target=self._tick, daemon=True, name="nightshift-progress")

    # -- what is shown ----------------------------------------------------------------------------
    def table(self):
        return progress_table(progress_rows(self.problems, self.history), self.kind,
                              self.budget_text() + (f" · {self.doing}" if self.doing else "") + self._now())

    def budget_text(self) -> str:
        b = self.budget
        return budget_line(b.spent if b else 0.0, self.gpu_hours, b.tried if b else len(self.history.records),
                           self.max_candidates, self.kind)

    def summary(self) -> str:
        passed = sum(1 for t in self.history.trials if t.status.value == "ok")
        bests = []
        for p in self.problems:
            rec = self.history.best(p.name)
            bests.append(f"{p.name} {times(rec.score(self.history.targets(p.name)))}" if rec else f"{p.name} -")
        return f"{len(self.history.trials)} trials, {passed} passed · best {', '.join(bests)} · {self.budget_text()}"

    def trial_line(self, trial: Trial) -> str:
        if trial.status.value == "ok":
            what = f"ok {times(trial.speedup)}" if trial.speedup else "ok"
            what += " (CPU timing)" if self.kind == "cpu" else ""
        else:
            what = f"{trial.status.value}: {trial.reason[:120]}"
        gen = f" on {trial.generation}" if len({g for p in self.problems for g in self.history.targets(p.name)}) > 1 \
            else ""
        return f"trial {self.count}: {trial.region} {trial.candidate_hash}{gen} {what} | {self.summary()}"

    # -- events -----------------------------------------------------------------------------------
    def start(self, text: str) -> None:
        self.write(text, to_lines=False)
        if self.live is not None:
            try:
                self.live.start()
            except OSError:
                self.live = None
        self.ticker.start()

    def set_budget(self, budget) -> None:
        self.budget = budget

    def trial(self, trial: Trial) -> None:
        self.count += 1
        self.write(self.trial_line(trial))
        if self.live is not None:
            try:
                self.live.update(self.table())
            except OSError:
                self.live = None

    def note(self, text: str) -> None:
        self.write(f"note: {text}", to_lines=False)

    def phase(self, text: str) -> None:
        """A long phase begins (integration): said now, and by every periodic line until the end."""
        self.doing = text
        self.write(text)

    def write(self, text: str, to_lines: bool = True) -> None:
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n"
        with self.lock:
            self.last_line = time.monotonic()
            for stream in ((self.log,) + ((self.lines,) if to_lines else ())):
                if stream is None:
                    continue
                try:
                    stream.write(line)
                    stream.flush()
                except (OSError, ValueError):  # a terminal that went away, a closed pipe
                    if stream is self.lines:
                        self.lines = None

    def _tick(self) -> None:
        while not self.closed.wait(min(self.interval, 5.0)):
            if (live := self.live) is not None:  # the live table's 'now:' moves while no trial ends
                try:
                    live.update(self.table())
                except OSError:
                    self.live = None
                except RuntimeError:  # the history changed under the view: the next tick shows it
                    pass
            if time.monotonic() - self.last_line >= self.interval:
                self.write(f"running: {self.doing or self.summary()}{self._now()}")

    def _now(self) -> str:
        try:
            now = self.in_flight()
        except Exception:  # a view of other threads' state: never worth stopping the run for
            return ""
        return f" · now: {'; '.join(now)}" if now else ""

    def close(self, text: str = "") -> None:
        self.closed.set()
        if self.ticker.is_alive():  # no thread of ours is left running when the process ends
            self.ticker.join(timeout=10)
        if self.live is not None:
            try:
                self.live.update(self.table())
                self.live.stop()
            except OSError:
                pass
            self.live = None
        if text:
            self.write(text, to_lines=False)
        if self.log is not None:
            self.log.close()
            self.log = None
