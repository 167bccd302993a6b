"""A device pool: the one way in for running trials on one device.

It owns what the runners of one device share: the device's lock (on a GPU a `DeviceLock`, held
across every tuner of the host while a worker times, shared while workers verify; none on the CPU, where lanes
time side by side), one reference worker (which never runs candidate code), and `workers`
`TrialRunner`s, siblings of each other, so the others stop while one times (`TrialRunner.quiet`);
on a GPU (and for CPU pools that lock), siblings of every other such pool's runners in this
process too.
`run` takes a free runner and returns a `Trial`, always: a harness error costs that trial
(status `lost`), not the night. Each trial is charged the device seconds no sibling was charged
already, so a device costs its wall time, never more.

The local executor keeps one pool per device, the Ray executor's actor one per GPU, `agent try`
one for its one trial; integration runs its ways of running the model side by side in more of
the pool's runners (`extra_runners`).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from sandbox.client import WorkerConfig
from sandbox.device_lock import DeviceLock, HostQuiet
from sandbox.reference import ReferenceWorker
from sandbox.runner import Limits, TrialRunner
from tools.trial import Candidate, Status, Trial


_LOCKS: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()
_RUNNERS: dict[str, list[TrialRunner]] = {}
_QUIET: dict[str, HostQuiet] = {}
_SHARED = threading.Lock()


def _shared(device: str) -> tuple[Any, list[TrialRunner], HostQuiet]:
    """One lock object, one sibling list and one HostQuiet per device in this process, for every
    pool on a GPU and every CPU pool that locks (integration's ways, its early baselines): each
    times alone with all the others' workers stopped and no judging in the tuner beside it, as
    the runners of one pool do."""
    with _SHARED:
        lock = _LOCKS.get(device)
        if lock is None:
            lock = _LOCKS[device] = DeviceLock(device, across_processes=device != "cpu")
        if device not in _QUIET:
            _QUIET[device] = HostQuiet(overlap=_judges_beside_timings(device))
        return lock, _RUNNERS.setdefault(device, []), _QUIET[device]


OVERLAP_CORES = 8
"""Host cores from which a GPU's timings no longer wait for the tuner's judges (HostQuiet)."""


def _judges_beside_timings(device: str) -> bool:
    """On a GPU host with OVERLAP_CORES or more, the tuner judges while a worker times a region:
    its kernels are timed on the device, the timing needs its worker's core and the reference
    worker's, and the tuner's comparisons are kept to a quarter of the cores (torch's threads in
    this process: nothing else in the tuner computes on the CPU). A whole model's timing, which
    counts its host's launches, still waits for the judges; on the CPU and on a small host,
    every timing does."""
    if device == "cpu":
        return False
    from tools.devices import host_cores
    cores = host_cores()
    if cores < OVERLAP_CORES:
        return False
    import torch
    torch.set_num_threads(max(1, min(torch.get_num_threads(), cores // 4)))
    return True


SEARCH_COMPILE_THREADS = 1
"""Inductor's compile threads in the search's workers (`WorkerConfig.compile_threads`): a
region compiles in seconds alone, and a compile pool ended its worker with the trial."""


class DevicePool:
    def __init__(self, device: str, problem_dirs: Iterable[Path] = (), *, workers: int = 1,
                 limits: Limits | None = None, memory_gb: float = 8.0, label: str | None = None,
                 cpu_lock: bool = False, compile_threads: int | None = None, nice: int = 0):
        """`device`: `cpu` or `cuda:N`. `label` names the device in trials (default: `device`).
        `cpu_lock`: on the CPU too, a timing holds the device alone and the others stop
        meanwhile (integration's ways of running the model); CPU lanes of the search do not wait
        for each other. `compile_threads`: the candidate workers' (WorkerConfig). `nice`: every
        worker's, the reference worker's too (both sides of a timing at one priority)."""
        self.device, self.label = device, label or device
        self.compile_threads, self.nice = compile_threads, nice
        self.limits, self.memory_gb = limits or Limits(), memory_gb
        self.problem_dirs = [Path(d) for d in problem_dirs]
        self.siblings: list[TrialRunner] = []
        """Each runner's `siblings`: this pool's runners, and every other locking pool's on the device."""
        self.lock: Any = None
        self.host_quiet: HostQuiet | None = None
        """Shared by the runners under the lock; CPU lanes that time side by side have none
        between them (each runner has its own, which only orders its own judge and timing)."""
        if device != "cpu" or cpu_lock:
            self.lock, self.siblings, self.host_quiet = _shared(device)
        self.reference = ReferenceWorker(WorkerConfig(device=device, memory_gb=memory_gb, nice=nice))
        self.runners: list[TrialRunner] = []
        """Every runner of the pool."""
        for _ in range(workers):
            self._add(self._runner())
        self.free: queue.Queue[TrialRunner] = queue.Queue()
        for r in self.runners:
            self.free.put(r)
        self.busy: dict[int, tuple[str, float]] = {}
        """id(runner) -> (candidate hash, monotonic start) of the trials running now."""
        self.charged_until = 0.0
        self.charge_lock = threading.Lock()
        self.cut: dict[int, str] = {}
        """id(runner) -> why its trial was stopped from outside (`cut`): the GPU-hours cap."""

    def _runner(self) -> TrialRunner:
        cfg = WorkerConfig(device=self.device, memory_gb=self.memory_gb, compile_threads=self.compile_threads,
                           nice=self.nice)
        r = TrialRunner(self.device, self.limits, cfg,
                        device_lock=self.lock, reference=self.reference, host_quiet=self.host_quiet)
        for d in self.problem_dirs:
            r.add_problem(d)
        r.siblings = self.siblings  # one list: a runner added later is every runner's sibling at once
        return r

    def _add(self, r: TrialRunner) -> None:
        self.runners.append(r)
        with _SHARED:
            self.siblings.append(r)

    def _remove(self, r: TrialRunner) -> None:
        if r in self.runners:
            self.runners.remove(r)
        self._leave([r])

    def _leave(self, runners: list[TrialRunner]) -> None:
        """Out of the sibling list (on a GPU shared with other pools: a closed pool's workers
        are not stopped or waited for)."""
        with _SHARED:
            for r in runners:
                if r in self.siblings:
                    self.siblings.remove(r)

    # -- running -----------------------------------------------------------------------------
    def run(self, candidate: Candidate, candidate_path: str = "", *,
            cancelled: Callable[[], bool] | None = None, **kwargs: Any) -> Trial | None:
        """The candidate's trial in the next free runner (`kwargs`: `TrialRunner.run`'s), its
        wall time in `phases["wall"]` and the device seconds it adds in `gpu_seconds`. None, and
        nothing charged, when `cancelled()` says so once it ends: an interrupted trial is not a
        result, so a resumed run tries it again."""
        runner = self.free.get()
        with self.charge_lock:  # `cut_running` sees a runner busy exactly while its trial runs
            self.busy[id(runner)] = (candidate.hash, time.monotonic())
            self.cut.pop(id(runner), None)
        try:
            trial = runner.run(candidate, candidate_path=candidate_path, **kwargs)
        except Exception as e:  # a harness bug costs this trial, not the night
            trial = Trial(region=candidate.region, candidate_hash=candidate.hash, status=Status.lost,
                          reason=f"harness error: {type(e).__name__}: {e}", device=self.label)
        finally:
            with self.charge_lock:
                self.busy.pop(id(runner), None)
                cut = self.cut.pop(id(runner), None)
            self.free.put(runner)
        if cancelled is not None and cancelled():
            return None
        if cut is not None:  # not the candidate's doing: lost, so a resume with room runs it again
            trial = Trial(region=candidate.region, candidate_hash=candidate.hash, planner=candidate.planner,
                          template=candidate.template, params=candidate.params, status=Status.lost, reason=cut,
                          gpu_seconds=trial.gpu_seconds, phases=trial.phases, started_at=trial.started_at,
                          finished_at=trial.finished_at or time.time(), candidate_path=candidate_path)
        trial.device = self.label
        trial.phases["wall"] = trial.gpu_seconds
        trial.gpu_seconds = self._charge(trial)
        return trial

    def _charge(self, trial: Trial) -> float:
        """Device seconds this trial adds: the part of its wall time not already charged to a
        sibling worker on this device, so a device costs its wall time, never more."""
        end, start = trial.finished_at, trial.finished_at - trial.gpu_seconds
        with self.charge_lock:
            done, self.charged_until = self.charged_until, max(self.charged_until, end)
            return max(0.0, end - max(start, done))

    def uncharged(self) -> float:
        """Device seconds the trials running now have held the device that no trial was charged
        yet: what finishing them now would add, at the least."""
        with self.charge_lock:
            starts = [t for _, t in self.busy.values()]
            if not starts:
                return 0.0
            now = time.time()
            return max(0.0, now - max(now - (time.monotonic() - min(starts)), self.charged_until))

    def cut_running(self, why: str) -> None:
        """Stop every trial running now (their workers killed); each ends `lost`, saying `why`,
        and is charged what it held the device."""
        with self.charge_lock:
            running = [r for r in list(self.runners) if id(r) in self.busy]
            self.cut.update({id(r): why for r in running})
        kills = [threading.Thread(target=r.worker.kill, daemon=True) for r in running]  # each waits for its process
        for k in kills:
            k.start()
        for k in kills:
            k.join()

    def running(self) -> dict[str, float]:
        """Candidates running on this device now: hash -> seconds since their trial started."""
        now = time.monotonic()
        return {h: now - t for h, t in list(self.busy.values())}

    def in_flight(self) -> list[str]:
        """What each running trial is doing now ('LlamaMLP 8453f559 timing decode 3 s')."""
        return [n for r in list(self.runners) if (n := r.now())]

    def interrupt(self) -> None:
        """Stop the trials running now (the tuner was interrupted); idle workers stay up."""
        for r in list(self.runners):
            if id(r) in self.busy:
                r.worker.kill()

    @contextlib.contextmanager
    def extra_runners(self, n: int) -> Iterator[list[TrialRunner]]:
        """`n` more runners on this device while the block runs: the pool's problems, lock and
        reference worker, siblings of its runners; never handed out by `run`. Closed after it."""
        extra = [self._runner() for _ in range(n)]
        for r in extra:
            self._add(r)
        try:
            yield extra
        finally:
            for r in extra:
                self._remove(r)
                r.close()

    def close(self) -> None:
        """Every worker closed (again, when called again: a trial running in another thread may
        have started one since)."""
        self._leave(self.runners)
        for r in list(self.runners):
            r.close()
        self.reference.close()
