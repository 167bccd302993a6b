"""Side-by-side timing of two callables on one device, the way kernel benchmarks should be.

- Warm-up first, so compilation and handle creation stay out of the numbers.
- The two callables alternate (A B, B A, ...), so drift in clocks or temperature hits both.
- On CUDA: L2 flushed before every repetition, CUDA events around the call, median taken.
- Calls are queued without host syncs (a flush and a short device sleep before each), so
  the host's launch overhead is not counted as device time, as in triton's do_bench.
- Work hidden on another stream is counted: in a separate pass, after the call's end event
  completes we wait for the whole device and measure how long that took beyond an idle
  device's wait. That excess is added to every sample and reported, so a candidate cannot
  hide its work there.
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

    def batch(self, calls: list[Callable[[], object]]) -> list[float]:
        """Event-timed ms of each call, queued back to back without host syncs (as do_bench
        does): a flush and a short device sleep before each call keep the GPU behind the CPU,
        so the host's launch overhead is not counted as device time."""
        pairs = []
        for fn in calls:
            self.flush_buf.zero_()
            torch.cuda._sleep(20_000)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in pairs]

    def hidden(self, fn: Callable[[], object]) -> float:
        """ms of device work still running on other streams after fn's stream finished."""
        self.flush_buf.zero_()
        torch.cuda.synchronize()
        end = torch.cuda.Event()
        fn()
        end.record()
        end.synchronize()
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        return max(0.0, (time.perf_counter() - t0) * 1e3 - self.idle_tail)


def _cpu_once(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_pair(baseline: Callable[[], object], candidate: Callable[[], object], device: torch.device,
              *, budget_ms: float = 400.0, min_reps: int = 10, max_reps: int = 200,
              warmup: int = 3) -> tuple[TimingStats, TimingStats]:
    """Time `baseline` and `candidate` interleaved on `device`; returns their stats.

    The number of repetitions is chosen from a warm-up estimate so that the pair takes about
    `budget_ms`, within [min_reps, max_reps]. Hidden (other-stream) time is included in the
    candidate's samples, and reported separately in `hidden_ms`.
    """
    def run(pairs: list[tuple[str, Callable[[], object]]]) -> list[float]:
        return clock.batch([f for _, f in pairs]) if clock else [_cpu_once(f) for _, f in pairs]

    clock = _CudaClock(device) if device.type == "cuda" else None
    run([("b", baseline), ("c", candidate)] * warmup)
    est = sum(run([("b", baseline), ("c", candidate)]))
    reps = int(max(min_reps, min(max_reps, budget_ms / max(est, 1e-3))))
    order = []
    for i in range(reps):  # alternate, so drift in clocks or temperature hits both alike
        order += [("b", baseline), ("c", candidate)] if i % 2 == 0 else [("c", candidate), ("b", baseline)]
    samples: dict[str, list[float]] = {"b": [], "c": []}
    for start in range(0, len(order), 64):  # bounded batches: events are cheap but not free
        chunk = order[start:start + 64]
        for (key, _), ms in zip(chunk, run(chunk)):
            samples[key].append(ms)
    hidden = {"b": [0.0], "c": [0.0]}
    if clock:
        hidden = {k: [clock.hidden(f) for _ in range(5)] for k, f in (("b", baseline), ("c", candidate))}
    extra = {k: statistics.median(v) for k, v in hidden.items()}
    # Work left on other streams is real work: it is added to every sample, and reported.
    return (_stats([x + extra["b"] for x in samples["b"]], hidden["b"]),
            _stats([x + extra["c"] for x in samples["c"]], hidden["c"]))
