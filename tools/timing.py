"""Side-by-side timing of two callables on one device, the way kernel benchmarks should be.

- Warm-up first, so compilation and handle creation stay out of the numbers.
- The two callables alternate (A B, B A, ...), so drift in clocks or temperature hits both.
- On CUDA: L2 flushed before every repetition, CUDA events around the call, median taken.
- Work hidden on another stream is counted: after the call's end event completes we wait
  for the whole device and measure how long that took beyond an idle device's wait. That
  excess is added to the time and reported, so a candidate cannot hide its work there.
- On the CPU the host clock is used, and every number is labelled a CPU timing.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class TimingStats:
    median_ms: float
    p20_ms: float
    p80_ms: float
    reps: int
    hidden_ms: float = 0.0
    """Median device time still running on other streams after the call's stream finished."""

    @property
    def spread(self) -> float:
        return (self.p80_ms - self.p20_ms) / self.median_ms if self.median_ms > 0 else 0.0


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _stats(samples: list[float], hidden: list[float] | None = None) -> TimingStats:
    return TimingStats(statistics.median(samples), _quantile(samples, 0.2), _quantile(samples, 0.8),
                       len(samples), statistics.median(hidden) if hidden else 0.0)


class _CudaClock:
    def __init__(self, device: torch.device):
        props = torch.cuda.get_device_properties(device)
        l2 = getattr(props, "L2_cache_size", 0) or (64 << 20)
        # Writing twice the L2's size evicts whatever the previous call left there.
        self.flush_buf = torch.empty(2 * l2, dtype=torch.int8, device=device)
        self.idle_tail = self._idle_tail()

    def _idle_tail(self) -> float:
        tails = []
        for _ in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.cuda.synchronize()
            tails.append((time.perf_counter() - t0) * 1e3)
        # A high quantile, so ordinary jitter of the wait is not charged as hidden work.
        return _quantile(tails, 0.9)

    def once(self, fn: Callable[[], object]) -> tuple[float, float]:
        """(event ms, hidden ms) of one call."""
        self.flush_buf.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        tail = (time.perf_counter() - t0) * 1e3
        return start.elapsed_time(end), max(0.0, tail - self.idle_tail)


def _cpu_once(fn: Callable[[], object]) -> tuple[float, float]:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3, 0.0


def time_pair(baseline: Callable[[], object], candidate: Callable[[], object], device: torch.device,
              *, budget_ms: float = 400.0, min_reps: int = 10, max_reps: int = 200,
              warmup: int = 3) -> tuple[TimingStats, TimingStats]:
    """Time `baseline` and `candidate` interleaved on `device`; returns their stats.

    The number of repetitions is chosen from a warm-up estimate so that the pair takes about
    `budget_ms`, within [min_reps, max_reps]. Hidden (other-stream) time is included in the
    candidate's samples, and reported separately in `hidden_ms`.
    """
    once = _CudaClock(device).once if device.type == "cuda" else _cpu_once
    for _ in range(warmup):
        once(baseline)
        once(candidate)
    est = once(baseline)[0] + once(candidate)[0]
    reps = int(max(min_reps, min(max_reps, budget_ms / max(est, 1e-3))))
    samples: dict[str, list[float]] = {"b": [], "c": []}
    hidden: dict[str, list[float]] = {"b": [], "c": []}
    for i in range(reps):
        order = (("b", baseline), ("c", candidate)) if i % 2 == 0 else (("c", candidate), ("b", baseline))
        for key, fn in order:
            ms, extra = once(fn)
            samples[key].append(ms + extra)
            hidden[key].append(extra)
    return _stats(samples["b"], hidden["b"]), _stats(samples["c"], hidden["c"])
