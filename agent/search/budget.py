"""The budget, literally as the method says: a GPU-hours cap over all devices, a candidate cap,
and patience per region. Parallel runs spend the budget faster; they never enlarge it.

Device time is each device's wall time while it runs trials (several sandbox workers sharing
one GPU cost its wall time once; N GPUs cost N times the wall time): each finished trial is
charged the part of its wall time no sibling was charged already. A launch is admitted only if
the time charged so far, plus what every trial in flight and this launch are expected to be
charged, stays within the cap. A trial is expected to cost what its region's recent trials were
charged (the most of them; a worker's one-time start left out); a region none of whose trials
has finished yet, a cold start's cost (`COLD_TRIAL_SECONDS`); alone on the devices, it is
admitted if the cap has room for the least a trial costs, and measures what the next ones cost.
So a small cap admits one first trial, not one per lane, before anything is measured. Workers
sharing a device take turns on it (verification and timing hold its lock), so reservations add
up, never overlap. A launch refused while others are in flight may fit once they end, so the
caller waits and asks again; only a refusal with nothing in flight ends the run.

Estimates can be wrong (a first trial, a worker restarted, a compile baseline's timing stopping
the search's workers beside it), so the cap does not rest on them: the executor watches what is
charged plus what the trials in flight have held (`over_cap`), and at the cap stops them. They end
`lost` (run again on a resume with room) and are charged what they held, so the cap is passed by
no more than the moment it takes to stop them.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from dataclasses import dataclass

from tools.problem import StopRule
from tools.trial import Trial

COLD_TRIAL_SECONDS = 120.0
"""What a region's first trials are expected to cost before one of them has finished: a cold
worker's start and first compiles (well over a minute for a full-size model's first trial)."""
DEFAULT_TRIAL_SECONDS = 20.0
"""The least a first trial is assumed to cost: a cap below it starts nothing."""
RECENT = 8
"""Trials per region the estimate looks back on."""


@dataclass
class Reservation:
    device: str
    region: str
    seconds: float


class Budget:
    def __init__(self, rule: StopRule, spent_seconds: float = 0.0, candidates_tried: int = 0):
        self.rule = rule
        self.spent = spent_seconds
        self.tried = candidates_tried
        self.in_flight: dict[int, Reservation] = {}
        self.recent: deque[float] = deque(maxlen=20)
        """Measured costs of the run's last trials, any region (the estimate of a new region)."""
        self.by_region: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=RECENT))
        self.best: dict[str, float] = defaultdict(lambda: 1.0)
        self.stale: dict[str, int] = defaultdict(int)
        self.changed = threading.Condition()
        self.next_region = threading.local()
        """The region the calling lane took its next job for (`taking`): executors launch by device."""
        self.stop_reason = ""
        self.exhausted = False
        """A launch was refused with nothing in flight: no further trial fits the cap."""
        self.held = 0.0
        """Device seconds the search leaves for re-timing its finalists at the end (`hold`)."""

    @property
    def cap_seconds(self) -> float:
        return self.rule.gpu_hours * 3600.0

    def estimate(self, region: str = "") -> float:
        """Device seconds one trial of `region` is expected to be charged: the most its recent
        trials were; for a region not measured yet, a cold start's cost or the most any was."""
        if self.by_region.get(region):
            return max(self.by_region[region])
        return max([COLD_TRIAL_SECONDS, *self.recent])

    def projected(self, extra: Reservation | None = None) -> float:
        """Seconds charged so far plus what the trials in flight (and `extra`) are expected to add."""
        return self.spent + sum(r.seconds for r in [*self.in_flight.values(), *([extra] if extra else [])])

    def taking(self, region: str) -> None:
        """The calling thread's next launch is a trial of `region` (the feed says so as a lane takes a job)."""
        self.next_region.region = region

    def try_launch(self, token: int, device: str = "", region: str | None = None) -> bool:
        """Reserve device time for one trial of `region` (default: what this thread last took).
        False if it would pass the cap now; then `exhausted` and `stop_reason` are set only if
        nothing is in flight (otherwise `wait` and ask again)."""
        region = region if region is not None else getattr(self.next_region, "region", "")
        with self.changed:
            est = self.estimate(region)
            mine = Reservation(device, region, est)
            unknown_alone = not self.in_flight and not self.by_region.get(region)
            need = self.held + (self.spent + DEFAULT_TRIAL_SECONDS if unknown_alone else self.projected(mine))
            if need > self.cap_seconds:
                if not self.in_flight:
                    self.exhausted = True
                    self.stop_reason = (f"device-hours cap (--gpu-hours): {self.spent / 3600:.4f} h spent of "
                                        f"{self.rule.gpu_hours:g} h, "
                                        f"next trial would take ~{need - self.held - self.projected():.0f} s"
                                        + (f", {self.held:.0f} s kept for timing the finalists again"
                                           if self.held else ""))
                return False
            self.in_flight[token] = mine
            return True

    def hold(self, finalists: dict[str, int]) -> None:
        """Keep room under the cap for re-timing `finalists` (region -> how many) once the search ends."""
        with self.changed:
            self.held = sum(n * self.estimate(region) for region, n in finalists.items())

    def release_held(self) -> None:
        """The search has ended: what it held back may be spent, on the finalists."""
        with self.changed:
            self.held, self.exhausted = 0.0, False
            self.changed.notify_all()

    def over_cap(self, running: float) -> bool:
        """Whether the time charged so far plus `running` (what the trials in flight have held the
        devices for and were not charged yet) reached the cap, less the room held for the
        finalists; then no launch follows (`exhausted`), and the caller stops the trials in flight."""
        with self.changed:
            if self.spent + running + self.held < self.cap_seconds:
                return False
            self.exhausted = True
            self.stop_reason = self.stop_reason or (
                f"device-hours cap (--gpu-hours): {self.rule.gpu_hours:g} h reached with trials running, "
                "which were stopped there")
            self.changed.notify_all()
            return True

    def wait(self, timeout: float) -> None:
        """Until a trial in flight finishes or is cancelled (or `timeout` seconds)."""
        with self.changed:
            self.changed.wait(timeout)

    def finish(self, token: int, trial: Trial) -> None:
        """Count a finished trial, whose `gpu_seconds` the executor has charged already."""
        with self.changed:
            self.in_flight.pop(token, None)
            self.spent += trial.gpu_seconds
            self._measured(trial)
            self.changed.notify_all()

    def remember(self, trials: list[Trial]) -> None:
        """Seed the estimates from a resumed run's last trials, so a resume expects trials to
        cost what they cost, not the cautious default."""
        with self.changed:
            for t in trials[-(self.recent.maxlen or 20):]:
                if t.gpu_seconds > 0:
                    self._measured(t)

    def _measured(self, trial: Trial) -> None:
        cost = _cost(trial)
        self.recent.append(cost)
        self.by_region[trial.region].append(cost)

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


def _cost(trial: Trial) -> float:
    """Device seconds the trial was charged, less its worker's one-time start: real cost, but no
    guide to the next trial on a warm worker."""
    return max(0.0, trial.gpu_seconds - trial.phases.get("start", 0.0))
