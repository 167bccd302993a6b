"""torch.compile of the untouched model, compiled, verified and timed while the search runs.

The compile baselines do not depend on what the search finds, and max-autotune alone compiles
for minutes: started beside the search, integration waits only for what is left of them. Each
way is the same trial as in integration (a worker of its own, verified on one draw of fresh
inputs, timed side by side with eager under the device lock). On a GPU its pool shares the
search's lock and sibling list (sandbox/pool.py): while a search trial times, these workers'
compiles are stopped, and while one of these times, the search's workers are. Their workers run at
a lower CPU priority (BASELINE_NICE): they compile in what the search leaves of the host's cores.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from agent.review.compile_caches import CompileCaches
from agent.review.ways import LIMITS, baseline_ways, side_by_side, whole_model
from sandbox.pool import DevicePool
from tools.runfolder import RunFolder
from tools.trial import Status, Trial


BASELINE_NICE = 10
"""The compile baselines' workers' niceness (both sides of their timings alike): Inductor's compile
processes of three modes run beside the search, which should keep first call on the host's cores.
The search's loads read 10.1 s a trial in the first half of the example's tune, while all three
modes compiled, and 2.8 s in the second (H100, 2026-12-06 16:34); niced, 6.5 and 2.1 s (19:00,
another H100). The host was 50-94% idle through the second run, so cores are not most of what a
load waits for. At 10 a search process gets about nine tenths of a core it shares with one of
these; an idle core still goes to them."""


class EarlyBaselines:
    def __init__(self, run: RunFolder, device: str | None, modes: list[str] | None = None,
                 on_step: Callable[[str], None] = lambda line: None, memory_gb: float = 8.0):
        """`modes`: names of ways.BASELINES (None: all). Checks the run's whole-model
        problem now (a UserError as integration would raise); starts nothing until `start`."""
        model, folder, _, self.device = whole_model(run, device)
        self.ways = baseline_ways(modes, model.seeded_calls)
        self.on_step = on_step
        self.pool = DevicePool(self.device, [folder], limits=LIMITS, memory_gb=memory_gb, cpu_lock=True,
                               nice=BASELINE_NICE)
        self.caches = CompileCaches(run.path)  # what each mode compiled, for integration's ways in that mode
        self.trials: dict[str, Trial] = {}
        self.thread = threading.Thread(target=self._run, name="early-baselines", daemon=True)
        self.closed = False
        self.after: threading.Event | None = None
        self.wait_s = 0.0

    def start(self, after: threading.Event | None = None, wait_s: float = 120.0) -> "EarlyBaselines":
        """Start; with `after`, only once it is set (the search's first trial ended: its workers'
        start and first compiles are not slowed by these) or `wait_s` passed."""
        self.after, self.wait_s = after, wait_s
        self.thread.start()
        return self

    def _run(self) -> None:
        if self.after is not None:
            self.after.wait(self.wait_s)
        if self.closed:
            self.pool.close()
            return
        t0 = time.monotonic()
        try:
            self.trials = side_by_side(self.pool, self.ways, self.on_step, caches=self.caches)
            self.on_step(f"compile baselines done, beside the search, in {time.monotonic() - t0:.0f}s")
        except Exception as e:  # integration runs what is missing itself
            if not self.closed:
                self.on_step(f"compile baselines beside the search failed ({type(e).__name__}: {e}); "
                             "integration runs them")
        finally:
            self.pool.close()

    def in_flight(self) -> list[str]:
        return self.pool.in_flight()

    def result(self, on_in_flight: Callable[[Callable[[], list[str]]], None] = lambda f: None) -> dict[str, Trial]:
        """The ways' trials once they end (waits); a way whose harness failed is left out, so
        integration runs it itself."""
        if self.thread.is_alive():
            on_in_flight(self.in_flight)
            self.thread.join()
        return {n: t for n, t in self.trials.items() if t.status is not Status.lost}

    def close(self) -> None:
        """Stop it (the search was interrupted, or nothing will be integrated)."""
        self.closed = True
        if self.after is not None:
            self.after.set()  # not waiting any longer
        if self.thread.ident is None:  # never started
            self.pool.close()
            return
        deadline = time.monotonic() + 60
        while True:  # a way may start a worker again after a close: close until the thread ends
            self.pool.close()
            self.thread.join(timeout=1.0)
            if not self.thread.is_alive() or time.monotonic() > deadline:
                return
