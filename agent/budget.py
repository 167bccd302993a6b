"""The budget, literally as the method says: a GPU-hours cap over all devices, a candidate cap,
and patience per region. Parallel runs spend the budget faster; they never enlarge it.

Device time is each device's wall time while it runs trials (several sandbox workers sharing
one GPU cost its wall time once; N GPUs cost N times the wall time). A launch is admitted only
if the time already charged, plus what every device is expected to be charged until its trials
in flight (and this launch) end, stays within the cap. A trial is expected to take as long as
the slowest recent trial, so the cap is overrun by at most the error of that estimate on each
device, never by a launch that was known to be too expensive. A launch refused while others
are in flight may fit once they end (they often end sooner than expected), so the caller waits
and asks again; only a refusal with nothing in flight ends the run.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass

from tools.problem import StopRule
from tools.trial import Trial

DEFAULT_TRIAL_SECONDS = 20.0


@dataclass
class Reservation:
    device: str
    start: float
    end: float


class Budget:
    def __init__(self, rule: StopRule, spent_seconds: float = 0.0, candidates_tried: int = 0):
        self.rule = rule
        self.spent = spent_seconds
        self.tried = candidates_tried
        self.in_flight: dict[int, Reservation] = {}
        self.charged_until: dict[str, float] = {}
        self.recent: deque[float] = deque(maxlen=20)
        self.best: dict[str, float] = defaultdict(lambda: 1.0)
        self.stale: dict[str, int] = defaultdict(int)
        self.changed = threading.Condition()
        self.stop_reason = ""
        self.exhausted = False
        """A launch was refused with nothing in flight: no further trial fits the cap."""

    @property
    def cap_seconds(self) -> float:
        return self.rule.gpu_hours * 3600.0

    def estimate(self) -> float:
        """Wall seconds one trial is expected to hold its device (worker start-up excluded)."""
        return max(self.recent) if self.recent else DEFAULT_TRIAL_SECONDS

    def projected(self, extra: Reservation | None = None) -> float:
        """Seconds charged so far plus what the trials in flight (and `extra`) will add."""
        by_device: dict[str, list[Reservation]] = defaultdict(list)
        for r in [*self.in_flight.values(), *([extra] if extra else [])]:
            by_device[r.device].append(r)
        ahead = 0.0
        for device, rs in by_device.items():
            since = max(self.charged_until.get(device, 0.0), min(r.start for r in rs))
            ahead += max(0.0, max(r.end for r in rs) - since)
        return self.spent + ahead

    def try_launch(self, token: int, device: str = "") -> bool:
        """Reserve `device` time for one trial. False if it would pass the cap now; then
        `exhausted` and `stop_reason` are set only if nothing is in flight (otherwise `wait` and ask again)."""
        with self.changed:
            now, est = time.time(), self.estimate()
            mine = Reservation(device, now, now + est)
            if self.projected(mine) > self.cap_seconds:
                if not self.in_flight:
                    self.exhausted = True
                    self.stop_reason = (f"GPU-hours cap: {self.spent / 3600:.4f} h spent of "
                                        f"{self.rule.gpu_hours:g} h, next trial would take ~{est:.0f} s")
                return False
            self.in_flight[token] = mine
            return True

    def wait(self, timeout: float) -> None:
        """Until a trial in flight finishes or is cancelled (or `timeout` seconds)."""
        with self.changed:
            self.changed.wait(timeout)

    def finish(self, token: int, trial: Trial) -> None:
        """Count a finished trial, whose `gpu_seconds` the executor has charged already."""
        with self.changed:
            mine = self.in_flight.pop(token, None)
            self.spent += trial.gpu_seconds
            device = mine.device if mine else trial.device
            self.charged_until[device] = max(self.charged_until.get(device, 0.0), trial.finished_at)
            self.recent.append(_held_seconds(trial))
            self.changed.notify_all()

    def remember(self, trials: list[Trial]) -> None:
        """Seed the per-trial estimate from a resumed run's last trials, so a resume expects
        trials to take what they took, not the cautious default."""
        with self.changed:
            for t in trials[-(self.recent.maxlen or 20):]:
                if t.phases.get("wall", t.gpu_seconds) > 0:
                    self.recent.append(_held_seconds(t))

    def cancel(self, token: int) -> None:
        with self.changed:
            self.in_flight.pop(token, None)
            self.changed.notify_all()

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


def _held_seconds(trial: Trial) -> float:
    """Wall seconds the trial held its device; a worker's one-time start is real cost
    (charged) but no guide to the next trial."""
    wall = trial.phases.get("wall", trial.gpu_seconds)
    return max(0.0, wall - trial.phases.get("start", 0.0))
