"""Timing, the way kernel benchmarks should be, split so that no number is taken on trust.

In a worker, `run_batch` times one callable over `reps` repetitions:

- every repetition gets inputs of its own, made in new memory just before it (fresh values,
  so no two calls in a run see the same data: caching by content, pointer, shape or call
  count returns wrong answers, which the tuner checks on a random sample of repetitions);
- on CUDA: the L2 cache flushed before every repetition, CUDA events around the call only,
  no host sync between repetitions (as triton's do_bench); one long device sleep first, so
  the host queues the whole run while the GPU sleeps and host launch gaps never show up as
  device time; the output copied (stream-ordered) right after the call's end event, so what
  is checked is what the call had produced when it was timed;
- on the CPU: the host clock around each call, labelled a CPU timing everywhere.

The tuner (sandbox/timed.py) then reads raw samples, never a worker's statistics. The
baseline is timed in a worker that never ran candidate code; a candidate's claimed total is
bounded by the tuner's own clock over the whole run, against the baseline's run of the same
shape (the same input making, flushes, copies and checksums around the calls). Noise is
measured as the spread between runs of the same code (A/A) and stored with every result.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

CPU_NOISE_FLOOR = 0.03
KEY_PERIOD = 7919
GPU_NOISE_FLOOR = 0.005


@dataclass(frozen=True)
class TimingStats:
    median_ms: float
    p20_ms: float
    p80_ms: float
    reps: int
    mean_ms: float = 0.0

    @property
    def spread(self) -> float:
        return (self.p80_ms - self.p20_ms) / self.median_ms if self.median_ms > 0 else 0.0


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def stats(samples: list[float]) -> TimingStats:
    """Median, p20 and p80 of finite, non-negative samples (computed in the tuner)."""
    xs = [float(x) for x in samples if isinstance(x, (int, float)) and math.isfinite(x) and x >= 0]
    if not xs:
        return TimingStats(math.inf, math.inf, math.inf, 0, math.inf)
    return TimingStats(quantile(xs, 0.5), quantile(xs, 0.2), quantile(xs, 0.8), len(xs), sum(xs) / len(xs))


def noise_band(medians: list[float], device_type: str) -> float:
    """Relative A/A band from the medians of repeated runs of the same callable: their
    max-min spread over their median, never under the device's floor."""
    floor = CPU_NOISE_FLOOR if device_type == "cpu" else GPU_NOISE_FLOOR
    xs = [m for m in medians if math.isfinite(m) and m > 0]
    if len(xs) < 2:
        return max(floor, 0.05)
    return max(floor, (max(xs) - min(xs)) / quantile(xs, 0.5))


def band_parts(base_medians: list[float], cand_medians: list[float], controls: list[float],
               device_type: str) -> dict[str, float]:
    """The parts an A/A band is made of (sandbox/timed.py `ab_band` says how): each side's
    spread over its runs, their paired ratios' spread, and the widest cross-process control
    counted as the verdict reads it (x or 1/x, less one)."""
    ratios = [c / b for c, b in zip(cand_medians, base_medians) if b > 0]
    return {"original": noise_band(base_medians, device_type), "candidate": noise_band(cand_medians, device_type),
            "ratio": noise_band(ratios, device_type) if len(ratios) >= 2 else 0.0,
            "control": max([max(x, 1.0 / x) - 1.0 for x in controls if x > 0 and math.isfinite(x)], default=0.0)}


# -- in the worker ----------------------------------------------------------------------------
class CudaClock:
    def __init__(self, device: torch.device):
        props = torch.cuda.get_device_properties(device)
        l2 = getattr(props, "L2_cache_size", 0) or (64 << 20)
        # Writing twice the L2's size evicts whatever the previous call left there.
        self.flush_buf = torch.empty(2 * l2, dtype=torch.int8, device=device)
        self.cycles_per_ms = self._calibrate()

    @staticmethod
    def _calibrate() -> float:
        """Device clock cycles per millisecond of torch.cuda._sleep, measured with events."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)
        torch.cuda.synchronize()
        start.record()
        torch.cuda._sleep(5_000_000)
        end.record()
        end.synchronize()
        return 5_000_000 / max(start.elapsed_time(end), 1e-3)


def checksum_key(n: int, seed: int, device: torch.device) -> torch.Tensor:
    """+-1 per element from an integer formula of (index, seed): the same on any device, so the
    tuner can recompute a worker's checksum from an output copy."""
    a, b = 2 * (seed % 1_000_003) + 1, seed % 999_983
    idx = torch.arange(min(n, KEY_PERIOD), device=device, dtype=torch.int64)
    one = ((idx * a + b) % KEY_PERIOD % 2).to(torch.float32).mul_(2).sub_(1)
    # The formula repeats every KEY_PERIOD elements: one period, tiled (not n int64 products).
    return one.repeat(-(-n // one.numel()))[:n] if n > one.numel() else one


def checksum_period(n: int, seed: int, device: torch.device | str) -> torch.Tensor:
    """The key's first period (all of it for fewer than KEY_PERIOD elements): what `checksum`
    needs, where the whole key of a KV cache's outputs is gigabytes."""
    return checksum_key(min(max(1, n), KEY_PERIOD), seed, device)


CHECKSUM_ROWS = 4096
"""Key periods per pass of `checksum`: about 32M elements (128 MB in float32) at a time."""


CPU_BLOCK = 1 << 20
"""Elements per pass of `checksum` on the CPU (about 4 MB in float32)."""


NONFINITE = {"nan": 7.0, "posinf": 11.0}
"""What a NaN and an infinity count as in a checksum: |x| * (+-1) summed would be inf - inf = NaN
for any output holding an infinity (masked logits), and a NaN checksum matches nothing."""


def finite_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| in float32, NaN and infinities as the finite codes of NONFINITE (in place on |x|'s new
    memory: no second temporary in the timed run's harness work)."""
    return x.float().abs().nan_to_num_(**NONFINITE)


def checksum(leaves: list, key: torch.Tensor | None) -> torch.Tensor:
    """sum |x_i| * key_i over the outputs, flattened in order, the key repeating every
    key.numel() elements (a 0-dim float32 tensor, on the outputs' device). Nonlinear in the
    outputs, so it cannot be had without computing them. Computed a block of key periods at a
    time (rows of a matrix-vector product): no float32 copy of all the outputs and no key as
    long as them, work the timed run does around every call."""
    flat = [t.detach().reshape(-1) for t in leaves if isinstance(t, torch.Tensor) and t.numel()]
    if not flat or key is None:
        return torch.zeros(())
    period = key.numel()
    total = torch.zeros((), dtype=torch.float32, device=flat[0].device)
    at = 0  # where this leaf starts in the flattened outputs: its phase in the key
    for x in flat:
        k = key.to(x.device)
        k = k.roll(-(at % period)) if at % period else k
        # On the CPU a block's float32 copy stays in the cache when it is small (a spot check's
        # comparison of a long prefill's output went from memory 4 times over at 32M elements).
        step = (CHECKSUM_ROWS if x.is_cuda else max(1, CPU_BLOCK // period)) * period
        for j in range(0, x.numel(), step):
            block = x[j:j + step]
            rows, tail = divmod(block.numel(), period)
            if rows:
                total += torch.mv(finite_abs(block[:rows * period].view(rows, period)), k).sum()
            if tail:
                total += (finite_abs(block[rows * period:]) * k[:tail]).sum()
        at += x.numel()
    return total


def run_batch(call: Callable[[Any], Any], make_inputs: Callable[[int], Any], reps: int,
              device: torch.device, clock: CudaClock | None, *, lead_cycles: float = 0.0,
              copy_out: Callable[[Any], Any] | None = None, keep: bool | set[int] = True, seed: int = 0,
              key_len: int = 1) -> dict:
    """`reps` timed repetitions of `call(make_inputs(i))`. Returns raw per-repetition times
    (`samples`, ms), the device gaps between repetitions (`gaps`, CUDA), the host time spent
    queueing (`host_ms`) and inside the calls (`host_calls_ms`, CUDA), the copies `copy_out` made of each output (`kept`: every
    repetition's when `keep` is True, only those whose index is in it when it is a set), and a
    checksum of each copy (`checksums`): the run's commitment to the outputs the tuner samples
    afterwards. The original's runs and the candidate's do exactly the same work around the
    calls, so the tuner can tell what the calls took from its own clock."""
    kept: list[Any] = []
    sums: list[torch.Tensor] = []
    key = checksum_period(key_len, seed, device) if copy_out is not None else None

    spent = {"draw": 0.0, "copy": 0.0}  # host seconds of the harness's own work, for bench/trial_cost.py

    def draw(i: int) -> Any:
        s = time.perf_counter()
        inputs = make_inputs(i)
        spent["draw"] += time.perf_counter() - s
        return inputs

    def keep_out(out: Any) -> None:
        if copy_out is None:
            return
        s = time.perf_counter()
        copies, meta = copy_out(out)
        sums.append(checksum(copies, key))
        if keep is True or (keep and len(sums) - 1 in keep):
            kept.append((copies, meta))
        spent["copy"] += time.perf_counter() - s

    t0 = time.perf_counter()
    if clock is None:
        samples = []
        for i in range(reps):
            inputs = draw(i)
            s = time.perf_counter()
            out = call(inputs)
            samples.append((time.perf_counter() - s) * 1e3)
            keep_out(out)
            del out, inputs
        return {"samples": samples, "gaps": [], "host_ms": (time.perf_counter() - t0) * 1e3, "kept": kept,
                "checksums": [float(x) for x in sums], "draw_ms": spent["draw"] * 1e3,
                "copy_ms": spent["copy"] * 1e3}
    events = []
    in_calls = 0.0
    if lead_cycles > 0:
        torch.cuda._sleep(int(lead_cycles))
    for i in range(reps):
        inputs = draw(i)
        clock.flush_buf.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s = time.perf_counter()
        start.record()
        out = call(inputs)
        end.record()
        in_calls += time.perf_counter() - s
        keep_out(out)
        events.append((start, end))
        del out, inputs
    host_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    samples = [s.elapsed_time(e) for s, e in events]
    gaps = [events[i][1].elapsed_time(events[i + 1][0]) for i in range(len(events) - 1)]
    return {"samples": samples, "gaps": gaps, "host_ms": host_ms, "host_calls_ms": in_calls * 1e3, "kept": kept,
            "checksums": [float(x) for x in sums], "draw_ms": spent["draw"] * 1e3, "copy_ms": spent["copy"] * 1e3}
