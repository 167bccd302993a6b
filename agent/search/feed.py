"""The queue between the search loop and the devices: jobs waiting for a free lane.

A job is (candidate, generation, saved path). The loop puts jobs as the planner proposes them;
every lane (a sandbox worker on a device, a Ray actor) takes the next job of its generation the
moment it is free, so there is no round for a slow trial to hold up. `close()` says no more
jobs will come: lanes drain what is queued, then end.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from typing import Iterator

from tools.trial import Candidate

Job = tuple[Candidate, str, str]


class Feed:
    def __init__(self, generations: list[str]):
        self.queues: dict[str, deque[Job]] = {g: deque() for g in generations}
        self.closed = False
        self.changed = threading.Condition()

    def put(self, jobs: list[Job], front: bool = False) -> None:
        with self.changed:
            if self.closed:
                return
            for job in reversed(jobs) if front else jobs:
                if job[1] not in self.queues:
                    raise ValueError(f"job for generation {job[1]!r}, which no lane serves "
                                     f"({', '.join(self.queues)})")
                (self.queues[job[1]].appendleft if front else self.queues[job[1]].append)(job)
            self.changed.notify_all()

    def take(self, generation: str, timeout: float = 0.0) -> Job | None:
        """The next job of `generation`, waiting up to `timeout` seconds for one; None if none came."""
        with self.changed:
            q = self.queues[generation]
            if not q and timeout > 0 and not self.closed:
                self.changed.wait(timeout)
            return q.popleft() if q else None

    def waiting(self, generation: str | None = None) -> int:
        with self.changed:
            return sum(len(q) for g, q in self.queues.items() if generation in (None, g))

    def drained(self, generation: str | None = None) -> bool:
        """Closed, and nothing of `generation` (of any, if None) is left to take."""
        return self.closed and not self.waiting(generation)

    def drop(self, region: str) -> list[Job]:
        """Take every queued job of `region` out (its search has ended); returns them."""
        with self.changed:
            out = []
            for g, q in self.queues.items():
                out += [j for j in q if j[0].region == region]
                self.queues[g] = deque(j for j in q if j[0].region != region)
            return out

    def close(self) -> None:
        with self.changed:
            self.closed = True
            self.changed.notify_all()


class LaneError:
    """What a lane thread died of (a store that cannot be written: the disk is full), put in its
    results so the loop that reads them raises it: one message and the command's exit, not a
    thread's traceback while the other lanes go on."""

    def __init__(self, error: BaseException):
        self.error = error


def results_of(results: queue.Queue, lanes: int, tick: float = 0.02) -> Iterator:
    """What lane threads put in `results` (each puts None once, when it ends), until every lane
    has ended; None whenever `tick` seconds pass without a result, so the caller can refill the feed.
    A lane's `LaneError` is raised here."""
    while lanes:
        try:
            item = results.get(timeout=tick)
        except queue.Empty:
            yield None
            continue
        if item is None:
            lanes -= 1
        elif isinstance(item, LaneError):
            raise item.error
        else:
            yield item
