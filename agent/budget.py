"""The budget, literally as the method says: a GPU-hours cap over all devices, a candidate cap,
and patience per region. Parallel runs spend the budget faster; they never enlarge it.

A launch is admitted only if the device time already spent, plus the time the trials still in
flight are expected to take, plus this launch's expected time, stays within the cap. The
expectation is the slowest recent trial, so the cap is overrun by at most the error of that
estimate on each device, never by a launch that was known to be too expensive.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque

from tools.problem import StopRule
from tools.trial import Trial

DEFAULT_TRIAL_SECONDS = 20.0


class Budget:
    def __init__(self, rule: StopRule, spent_seconds: float = 0.0, candidates_tried: int = 0):
        self.rule = rule
        self.spent = spent_seconds
        self.tried = candidates_tried
        self.in_flight: dict[int, float] = {}
        self.recent: deque[float] = deque(maxlen=20)
        self.best: dict[str, float] = defaultdict(lambda: 1.0)
        self.stale: dict[str, int] = defaultdict(int)
        self.lock = threading.Lock()
        self.stop_reason = ""

    @property
    def cap_seconds(self) -> float:
        return self.rule.gpu_hours * 3600.0

    def estimate(self) -> float:
        return max(self.recent) if self.recent else DEFAULT_TRIAL_SECONDS

    def try_launch(self, token: int) -> bool:
        """Reserve device time for one trial; False (and a stop reason) if it would pass the cap."""
        with self.lock:
            est = self.estimate()
            # Trials in flight are expected to cost what trials cost now, not the guess made
            # when they started (the first launches only had a default to go on).
            if self.spent + est * len(self.in_flight) + est > self.cap_seconds:
                self.stop_reason = (f"GPU-hours cap: {self.spent / 3600:.4f} h spent of {self.rule.gpu_hours:g} h, "
                                    f"next trial would take ~{est:.0f} s")
                return False
            self.in_flight[token] = est
            return True

    def finish(self, token: int, trial: Trial) -> None:
        with self.lock:
            self.in_flight.pop(token, None)
            self.spent += trial.gpu_seconds
            # A worker's one-time start is real cost (charged) but no guide to the next trial.
            self.recent.append(max(0.0, trial.gpu_seconds - trial.phases.get("start", 0.0)))

    def cancel(self, token: int) -> None:
        with self.lock:
            self.in_flight.pop(token, None)

    def admit(self, n: int) -> int:
        """How many of n new candidates the candidate cap still allows (and count them)."""
        take = max(0, min(n, self.rule.max_candidates - self.tried))
        self.tried += take
        if take < n:
            self.stop_reason = f"candidate cap: {self.rule.max_candidates} candidates tried"
        return take

    def observe(self, region: str, kept_speedup: float | None) -> None:
        """Patience: count passing trials that do not beat the region's best."""
        if kept_speedup is None:
            return
        if kept_speedup > self.best[region] * 1.005:
            self.best[region] = kept_speedup
            self.stale[region] = 0
        else:
            self.stale[region] += 1

    def region_open(self, region: str) -> bool:
        return self.stale[region] < self.rule.patience
