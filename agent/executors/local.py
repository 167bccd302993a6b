"""Local executor: one sandbox worker per idle device of this machine, run in parallel.

Devices are grouped by hardware generation. Every candidate is queued once per target
generation (`agent.search.feed.Feed`), and any free lane of that generation takes it at once, so N
devices of a generation give N trials at a time, and a slow trial holds up only its own lane. GPUs that already carry other people's work are left alone. The
CPU is a device when there is no GPU. Before each launch the budget is asked; a launch that
would pass the GPU-hours cap waits for the trials in flight, and is not started if it
still would once they have ended. Trials still running when the cap is reached are stopped.
"""

from __future__ import annotations

import itertools
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from agent.search.budget import Budget
from agent.search.feed import Feed, LaneError, results_of
from sandbox.client import WorkerConfig
from sandbox.spawn import spares_on
from sandbox.pool import SEARCH_COMPILE_THREADS, DevicePool
from sandbox.runner import Limits, TrialRunner
from tools.screen import ScreenBar
from tools.trial import Candidate, Trial

BUSY_MEMORY_BYTES = 2 << 30
OWN_CONTEXT_BYTES = 1 << 30


CAP_WATCH_S = 0.1
"""How often the GPU-hours cap is checked against what the running trials have held."""

BUSY_NOTE = "left alone"
"""How a GPU skipped for other work's memory is named in the notes (run_tune reads it)."""


@dataclass
class Slot:
    device: str
    generation: str
    """A label: `sm90`, `cpu`, or a simulated one given as `cpu@gen-b`."""


def parse_devices(spec: str | None) -> tuple[list[Slot], list[str]]:
    """Slots from `--devices` (e.g. `cuda:0,cuda:1` or `cpu@a,cpu@b`), or every idle GPU, or the CPU.
    Returns (slots, notes about devices left alone)."""
    notes: list[str] = []
    if spec:
        slots = []
        for item in (s.strip() for s in spec.split(",") if s.strip()):
            dev, _, label = item.partition("@")
            if dev != "cpu" and not dev.startswith("cuda"):
                raise ValueError(f"unknown device {item!r}: use cpu, cuda or cuda:N (optionally @label)")
            if dev.startswith("cuda"):
                import torch  # here: `agent tune` checks its flags before paying for torch's import
                if not torch.cuda.is_available():
                    raise ValueError(f"device {item!r} asked for, but CUDA is not available here")
                dev = dev if ":" in dev else "cuda:0"
                if int(dev.split(":")[1]) >= torch.cuda.device_count():
                    raise ValueError(f"device {dev} does not exist (this machine sees {torch.cuda.device_count()})")
            slots.append(Slot(dev, label or _generation(dev)))
        return slots, notes
    import torch
    if torch.cuda.is_available():
        slots = []
        torch.cuda.empty_cache()
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            # Our own process (profiling, references) is not "other people's work", nor are the
            # workers started for this search ahead of it (a context and a cache-flush buffer each).
            ours = OWN_CONTEXT_BYTES * (1 + spares_on(f"cuda:{i}"))
            others = total - free - torch.cuda.memory_reserved(i) - ours
            if others > BUSY_MEMORY_BYTES:
                notes.append(f"cuda:{i} {BUSY_NOTE}: {others / 2**30:.1f} GiB in use by other work")
                continue
            slots.append(Slot(f"cuda:{i}", _generation(f"cuda:{i}")))
        if slots:
            return slots, notes
        notes.append("no idle GPU: using the CPU")
    return [Slot("cpu", "cpu")], notes


def _generation(device: str) -> str:
    if device == "cpu":
        return "cpu"
    import torch
    props = torch.cuda.get_device_properties(torch.device(device))
    arch = getattr(props, "gcnArchName", "")
    return arch.split(":")[0] if arch and arch.startswith("gfx") else f"sm{props.major}{props.minor}"


LANE_END_S = 30.0
"""How long `close` waits for a lane whose workers it killed (its trial then ends in seconds)."""

LANE_DEVICE_GIB = 12
"""Device memory a lane needs at most, in GiB: on the H100 (79 GiB) 8 lanes of the example, its
reference worker and the three compile baselines beside them reached 80 GiB and seven trials of 122
failed out of memory (2026-12-06); 6 lanes (79 // 12) ran without on earlier H100 runs."""


def default_workers_per_gpu(gpus: int) -> int:
    """Workers sharing one GPU: enough that one is always ready to verify or time while the
    others import and compile on the CPU (compiling is the slow part of a cheap trial), but
    no more than the CPU cores can feed (about two cores per worker) or the smallest GPU's
    memory can hold (`LANE_DEVICE_GIB` each), and at most 8 (on an H100 host of 16 cores, 6
    lanes left the device lock idle 56% of a tune while they loaded and compiled)."""
    from tools.devices import host_cores
    return workers_per_gpu(host_cores(), gpus, _smallest_gpu_gib())


def _smallest_gpu_gib() -> float | None:
    import torch
    if not torch.cuda.is_available() or not torch.cuda.device_count():
        return None
    return min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())) / 2**30


def workers_per_gpu(cores: int, gpus: int, device_gib: float | None = None) -> int:
    by_memory = int(device_gib // LANE_DEVICE_GIB) if device_gib else 8
    return max(2, min(8, by_memory, cores // (2 * max(1, gpus))))


def _lanes(slot: Slot, slots: list[Slot], workers_per_device: int | None) -> int:
    gpus = len([s for s in slots if s.device != "cpu"])
    return (workers_per_device or default_workers_per_gpu(gpus)) if slot.device != "cpu" else 1


def _workers(slots: list[Slot], workers_per_device: int | None) -> dict[str, int]:
    """Device -> the workers its pool runs (every slot naming it adds its lanes)."""
    workers: dict[str, int] = {}
    for s in slots:
        workers[s.device] = workers.get(s.device, 0) + _lanes(s, slots, workers_per_device)
    return workers


def spare_configs(devices: str | None, run_path: Path, model_file: str, memory_gb: float = 8.0,
                  workers_per_device: int | None = None) -> list[WorkerConfig]:
    """The workers a LocalExecutor of this run will start (each device's reference worker and
    its lanes), configured as its pools configure them, for `sandbox.client.prestart`."""
    slots, _ = parse_devices(devices)
    seen = dict(hide=[str(Path(run_path).resolve())], model_files=[model_file], memory_gb=memory_gb)
    return [c for d, n in _workers(slots, workers_per_device).items()
            for c in [WorkerConfig(device=d, role="reference", **seen)]
            + [WorkerConfig(device=d, compile_threads=SEARCH_COMPILE_THREADS, **seen) for _ in range(n)]]


class LocalExecutor:
    def __init__(self, slots: list[Slot], problem_dirs: list[Path], limits: Limits | None = None,
                 memory_gb: float = 8.0, workers_per_device: int | None = None):
        """`workers_per_device` (default: `default_workers_per_gpu` on GPUs, 1 on the CPU): while
        one worker times on the device (or two verify: the device's lock), the others import
        and compile their next candidates and the tuner judges the last outputs, so the GPU does
        not wait. One `DevicePool` per device (slots naming one device share it, and its reference
        worker and charging); each of its workers is a lane, fed with its slot's generation."""
        self.slots, self.lanes = slots, []
        workers = _workers(slots, workers_per_device)
        for s in slots:
            self.lanes += [s] * _lanes(s, slots, workers_per_device)
        self.pools = {d: DevicePool(d, problem_dirs, workers=n, limits=limits, memory_gb=memory_gb,
                                    compile_threads=SEARCH_COMPILE_THREADS)
                      for d, n in workers.items()}
        self.tokens = itertools.count()
        self.lane_threads: list[threading.Thread] = []

    @property
    def runners(self) -> list[TrialRunner]:
        """Every sandbox runner, one per lane (the loop sizes its batches by them)."""
        return [r for pool in self.pools.values() for r in pool.runners]

    @property
    def generations(self) -> list[str]:
        return sorted({s.generation for s in self.slots})

    def run(self, feed: Feed, budget: Budget, should_stop: Callable[[], bool] = lambda: False,
            on_start: Callable[[Candidate, str], None] = lambda c, g: None,
            screen: Callable[[str, str], ScreenBar | None] = lambda r, g: None) -> Iterator[Trial | None]:
        """Every lane takes the next job of its generation from `feed` as soon as it is free;
        yields trials as they finish, and None when none finished for a moment (so the caller
        can refill the feed). Ends once the feed is closed and drained, the budget is spent, or
        `should_stop`. `on_start(candidate, generation)` is called from a lane's thread."""
        results: queue.Queue = queue.Queue()
        left = threading.Event()  # the caller stopped reading early (a second signal, an error)

        def stopped() -> bool:
            return should_stop() or left.is_set()

        def work(slot: Slot) -> None:
            pool = self.pools[slot.device]
            try:
                while not stopped() and not budget.exhausted and not feed.drained(slot.generation):
                    job = feed.take(slot.generation, timeout=0.1)
                    if job is None:
                        continue
                    cand, gen, path = job
                    token = next(self.tokens)
                    while not budget.try_launch(token, slot.device):
                        if budget.exhausted or stopped():
                            return
                        budget.wait(0.5)  # a sibling's trial may end sooner than reserved
                    on_start(cand, gen)
                    trial = pool.run(cand, candidate_path=path, cancelled=stopped, screen=screen(cand.region, gen))
                    if trial is None:  # interrupted mid-trial: not a result, so resume runs it again
                        budget.cancel(token)
                        return
                    trial.generation = slot.generation
                    budget.finish(token, trial)
                    results.put(trial)
            except Exception as e:
                results.put(LaneError(e))
            finally:
                results.put(None)

        ended = threading.Event()

        def watch() -> None:  # the cap is a cap: trials still running when it is reached are stopped
            while not ended.wait(CAP_WATCH_S):
                if budget.over_cap(sum(pool.uncharged() for pool in self.pools.values())):
                    for pool in self.pools.values():
                        pool.cut_running(f"stopped at the GPU-hours cap (--gpu-hours {budget.rule.gpu_hours:g}): not a "
                                         "verdict on the candidate; a resume with more hours runs it again")
                    return

        threads = [threading.Thread(target=work, args=(s,), daemon=True) for s in self.lanes]
        self.lane_threads += threads
        for t in threads:
            t.start()
        threading.Thread(target=watch, daemon=True, name="nightshift-cap").start()
        try:
            yield from results_of(results, len(threads))
        finally:
            ended.set()
            if any(t.is_alive() for t in threads):  # their trials are cut short; `close` waits for them
                left.set()
                for pool in self.pools.values():
                    pool.interrupt()

    def in_flight(self) -> list[str]:
        return [n for pool in self.pools.values() for n in pool.in_flight()]

    def close(self) -> None:
        """Every worker closed, then every lane ended: a lane left inside torch when the process
        exits aborts it (Python unwinds a daemon thread through torch's C++ frames: SIGABRT)."""
        for pool in self.pools.values():
            pool.close()
        for t in self.lane_threads:
            t.join(timeout=LANE_END_S)
