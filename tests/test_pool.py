"""The device pool (sandbox/pool.py), the one way in for trials on one device: its runners share
one lock and one reference worker as siblings, a harness error costs one trial, a device is
charged its wall time and never more, an interrupt stops only the trial running, and close()
leaves no worker behind.

On the CPU with `tests/models/tiny_rmsnorm.py` (one RMSNorm region, 8x64 inputs) and pure torch
candidates, untimed, so a trial costs a worker start and a fraction of a second.
"""

import os
import threading
import time
from pathlib import Path

import pytest

from sandbox import client
from sandbox.device_lock import DeviceLock
from sandbox.pool import DevicePool
from sandbox.runner import Limits
from tools import verify
from tools.trial import Candidate, Status

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "models" / "tiny_rmsnorm.py"
REGION = "RMSNorm"
LIMITS = Limits(compile_s=60, run_s=30, time_s=60, budget_ms=50, max_reps=20)

RIGHT = """import torch
def forward(module, x):
    xf = x.float()
    return module.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.eps)).to(x.dtype)
"""
SLOW_IMPORT = "import time\ntime.sleep(60)\n" + RIGHT


@pytest.fixture(scope="module")
def problem_dir(tmp_path_factory) -> Path:
    from agent.setup.jobs import profile_and_freeze
    res = profile_and_freeze(TINY, "cpu", None, tmp_path_factory.mktemp("pool-runs"))
    return res.run.problems_dir / REGION


def candidate(source: str = RIGHT, variant: int = 0) -> Candidate:
    return Candidate(region=REGION, source=source + f"# variant {variant}\n", planner="stub")


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie has ended
    except FileNotFoundError:
        return True


def test_runners_of_one_pool_are_siblings_sharing_one_lock_and_one_reference(problem_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("NIGHTSHIFT_LOCK_DIR", str(tmp_path / "locks"))
    gpu = DevicePool("cuda:0", [problem_dir], workers=3, limits=LIMITS)  # no worker starts before a trial
    cpu = DevicePool("cpu", [problem_dir], workers=2, limits=LIMITS)
    ways = DevicePool("cpu", [problem_dir], limits=LIMITS, cpu_lock=True)
    # Another pool on the same GPU in this process (integration's early compile baselines beside
    # the search): one lock object and one sibling list, so either pool's timing stops the other's
    # workers; another GPU is apart.
    beside = DevicePool("cuda:0", [problem_dir], limits=LIMITS, cpu_lock=True)
    other_gpu = DevicePool("cuda:1", [problem_dir], limits=LIMITS)
    try:
        assert isinstance(gpu.lock, DeviceLock) and len(gpu.runners) == 3
        for pool in (gpu, cpu, ways):
            for r in pool.runners:
                assert r.reference is pool.reference and not r.own_reference
                assert set(r.problems) == {REGION} and r.limits is LIMITS
        for pool in (cpu, ways):
            assert all(r.siblings == pool.runners for r in pool.runners)
        assert beside.lock is gpu.lock and other_gpu.lock is not gpu.lock
        assert all(r.siblings == [*gpu.runners, *beside.runners] for r in gpu.runners + beside.runners)
        assert other_gpu.runners[0].siblings == other_gpu.runners
        assert all(r.device_lock is gpu.lock for r in gpu.runners)
        assert all(r.host_quiet is gpu.host_quiet for r in gpu.runners + beside.runners)  # no judging beside a timing
        with beside.extra_runners(1) as extra:
            assert gpu.runners[0].siblings[-1] is extra[0] and extra[0].device_lock is gpu.lock
        beside.close()
        assert gpu.runners[0].siblings == gpu.runners  # a closed pool's workers are nobody's siblings
        # CPU lanes time side by side: no lock between them, so none stops another (TrialRunner.quiet)
        assert cpu.lock is None and cpu.runners[0].device_lock is not cpu.runners[1].device_lock
        assert cpu.runners[0].host_quiet is not cpu.runners[1].host_quiet  # nor a judge-timing order
        with ways.extra_runners(2) as extra:
            assert ways.runners == [ways.runners[0], *extra]
            assert all(r.device_lock is ways.lock and r.reference is ways.reference for r in extra)
            assert all(r.siblings == ways.runners for r in ways.runners)
        assert len(ways.runners) == 1 and ways.free.qsize() == 1  # extra runners are never handed out
    finally:
        for pool in (gpu, cpu, ways, beside, other_gpu):
            pool.close()


def test_a_harness_error_is_a_lost_trial_and_the_pool_keeps_working(problem_dir, monkeypatch):
    pool = DevicePool("cpu", [problem_dir], limits=LIMITS, label="cpu@here")
    judge = verify.judge
    calls = []

    def broken_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyError("a bug in the judge")
        return judge(*args, **kwargs)
    monkeypatch.setattr(verify, "judge", broken_once)
    try:
        lost = pool.run(candidate(), do_time=False)
        assert lost.status is Status.lost and lost.reason == "harness error: KeyError: 'a bug in the judge'"
        assert lost.device == "cpu@here" and lost.gpu_seconds == 0.0
        assert pool.free.qsize() == 1 and pool.running() == {}  # its runner is free again
        ok = pool.run(candidate(variant=1), candidate_path="c.py", do_time=False)
        assert ok.status is Status.ok, ok.reason
        assert ok.device == "cpu@here" and ok.candidate_path == "c.py" and not ok.timings
        assert ok.phases["wall"] + 1e-3 >= ok.gpu_seconds > 0  # two clocks: wall is monotonic, the charge time.time()
    finally:
        pool.close()


def test_overlapping_trials_on_one_device_are_charged_no_more_than_its_wall_time(problem_dir):
    pool = DevicePool("cpu", [problem_dir], workers=2, limits=LIMITS)
    trials = []
    try:
        t0 = time.time()
        lanes = [threading.Thread(target=lambda i=i: trials.append(pool.run(candidate(variant=i), do_time=False)))
                 for i in range(2)]
        for t in lanes:
            t.start()
        for t in lanes:
            t.join()
        elapsed = time.time() - t0
    finally:
        pool.close()
    assert [t.status for t in trials] == [Status.ok, Status.ok], [t.reason for t in trials]
    walls = [t.phases["wall"] for t in trials]
    charged = [t.gpu_seconds for t in trials]
    assert all(0 <= c <= w + 1e-6 for c, w in zip(charged, walls))
    assert sum(charged) <= elapsed + 1e-3  # both workers started at once: their trials overlapped
    assert sum(charged) < sum(walls)


def test_interrupt_stops_the_running_trial_and_an_interrupted_trial_is_not_charged(problem_dir):
    pool = DevicePool("cpu", [problem_dir], limits=LIMITS)
    slow = candidate(SLOW_IMPORT)
    out = []
    try:
        lane = threading.Thread(target=lambda: out.append(pool.run(slow, cancelled=lambda: True)))
        t0 = time.monotonic()
        lane.start()
        while slow.hash not in pool.running() and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        assert slow.hash in pool.running()
        time.sleep(1.0)  # into its import
        pool.interrupt()
        lane.join(timeout=30)
        assert not lane.is_alive() and time.monotonic() - t0 < 40  # not the 60 s the candidate sleeps
        assert out == [None] and pool.charged_until == 0.0 and pool.running() == {}
        after = pool.run(candidate(), do_time=False)  # a fresh worker serves the next trial
        assert after.status is Status.ok, after.reason
    finally:
        pool.close()


def test_every_worker_is_seen_by_stop_all_and_close_leaves_none_alive(problem_dir):
    pool = DevicePool("cpu", [problem_dir], workers=2, limits=LIMITS)
    try:
        lanes = [threading.Thread(target=pool.run, args=(candidate(variant=i),), kwargs={"do_time": False})
                 for i in range(2)]
        for t in lanes:
            t.start()
        for t in lanes:
            t.join()
        workers = [r.worker for r in pool.runners] + [pool.reference.worker]
        assert all(w.alive for w in workers)
        pids = [w.proc.pid for w in workers]
        assert all(w in client._LIVE for w in workers)  # what a signal's stop_all kills
    finally:
        pool.close()
    assert not any(w.alive for w in workers)
    deadline = time.monotonic() + 10
    while not all(gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(gone(p) for p in pids), [p for p in pids if not gone(p)]


def test_a_worker_started_ahead_is_adopted_by_the_same_configuration_and_dropped_otherwise(tmp_path):
    """The search's workers start while the model is profiled and frozen (a start was 30 of the
    41 s to the H200's first trial): a handle with the same configuration takes the spare, one
    with another configuration never does, and spares nobody took are killed."""
    from sandbox import client as C
    cfg = dict(device="cpu", hide=[str(tmp_path / "run")], model_files=[])
    assert C.prestart([C.WorkerConfig(**cfg), C.WorkerConfig(**cfg, role="reference")]) == 2
    from sandbox.spawn import _SPARES
    spares = [s.proc for waiting in _SPARES.values() for s in waiting]
    other = C.Worker(C.WorkerConfig(device="cpu", hide=[str(tmp_path / "another run")]))
    mine = C.Worker(C.WorkerConfig(**cfg))
    try:
        assert mine.start().ok and mine.proc in spares and mine.starts == 1
        assert other.start().ok and other.proc not in spares  # not the reference's spare either
        assert C.drop_spares() == 1
        left = next(p for p in spares if p is not mine.proc)
        assert left.poll() is not None and mine.alive  # the leftover killed, the adopted one kept
    finally:
        mine.kill()
        other.kill()
        C.drop_spares()


def test_the_search_workers_compile_in_their_own_process_and_are_prestarted_so(problem_dir, tmp_path):
    """A torch.compile candidate started inductor's compile pool, which outlived its trial and
    so ended its worker (9 of 50 trials on the H200 paid a 25-75 s worker start after one). The
    search's workers compile in their own process (TORCHINDUCTOR_COMPILE_THREADS=1), the spares
    started ahead for them are configured alike, and integration's ways keep inductor's default."""
    from agent.executors.local import LocalExecutor, Slot, spare_configs

    def env_of(runner) -> dict:
        assert runner.worker.start().ok
        out = {}
        for pid in runner.worker.members():
            try:
                for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    k, _, v = item.decode(errors="replace").partition("=")
                    out.setdefault(k, v)
            except OSError:
                pass
        return out
    ex = LocalExecutor([Slot(device="cpu", generation="cpu")], [problem_dir], limits=LIMITS)
    other = DevicePool("cpu", [problem_dir], limits=LIMITS, cpu_lock=True)
    try:
        assert env_of(ex.runners[0]).get("TORCHINDUCTOR_COMPILE_THREADS") == "1"
        assert "TORCHINDUCTOR_COMPILE_THREADS" not in env_of(other.runners[0])
    finally:
        ex.close()
        other.close()
    configs = spare_configs("cpu", tmp_path / "run", str(TINY))
    assert sorted(c.compile_threads or 0 for c in configs) == [0, 1]  # the reference's, the lane's
    assert all(c.compile_threads == 1 for c in configs if c.role == "candidate")


def test_the_compile_baselines_beside_the_search_run_at_a_lower_cpu_priority(problem_dir):
    """Inductor's compiles of three modes run beside the search, which keeps first call on the
    host's cores: the early baselines' workers, both sides of their timings, run niced, and so
    does what they start; the search's workers keep the tuner's priority."""
    from agent.review.early_baselines import BASELINE_NICE

    def niceness(worker) -> set[int]:
        assert worker.start().ok
        return {os.getpriority(os.PRIO_PROCESS, pid) for pid in worker.members()}
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    baselines = DevicePool("cpu", [problem_dir], limits=LIMITS, cpu_lock=True, nice=BASELINE_NICE)
    search = DevicePool("cpu", [problem_dir], limits=LIMITS)
    try:
        assert niceness(baselines.runners[0].worker) == {min(19, mine + BASELINE_NICE)}
        assert niceness(baselines.reference.worker) == {min(19, mine + BASELINE_NICE)}
        assert niceness(search.runners[0].worker) == {mine}
    finally:
        baselines.close()
        search.close()


def test_no_judging_in_the_tuner_beside_a_timing(problem_dir, monkeypatch):
    """Judging a trial's outputs is the tuner's own CPU work, outside the device lock; beside
    another runner's timing of a host-bound model it took that worker's cores. Two runners of
    a locking pool, a judge slow enough to overlap: no judge runs while a timing does."""
    from sandbox import spot, timed
    spans: dict[str, list[tuple[float, float]]] = {"judge": [], "time": []}
    judge, workload = verify.judge, timed._workload

    def slow_judge(*args, **kwargs):
        t0 = time.monotonic()
        time.sleep(0.4)
        out = judge(*args, **kwargs)
        spans["judge"].append((t0, time.monotonic()))
        return out

    def recorded(*args, **kwargs):
        t0 = time.monotonic()
        out = workload(*args, **kwargs)
        spans["time"].append((t0, time.monotonic()))
        return out
    pool = DevicePool("cpu", [problem_dir], workers=2, limits=LIMITS, cpu_lock=True)
    compare = spot.compare

    def spot_compare(*args, **kwargs):  # a spot check's comparison is judging too, off the lock
        t0 = time.monotonic()
        out = compare(*args, **kwargs)
        spans["judge"].append((t0, time.monotonic()))
        return out
    monkeypatch.setattr(verify, "judge", slow_judge)
    monkeypatch.setattr(timed, "_workload", recorded)
    monkeypatch.setattr(spot, "compare", spot_compare)
    trials = []
    try:
        lanes = [threading.Thread(target=lambda i=i: trials.extend(pool.run(candidate(variant=2 * i + k))
                                                                    for k in range(2)))
                 for i in range(2)]
        for t in lanes:
            t.start()
        for t in lanes:
            t.join()
    finally:
        pool.close()
    assert [t.status for t in trials] == [Status.ok] * 4, [t.reason for t in trials]
    assert len(spans["judge"]) >= 4 + len(spans["time"]) and len(spans["time"]) >= 4  # a spot check per workload
    overlaps = [(j, w) for j in spans["judge"] for w in spans["time"] if j[0] < w[1] and w[0] < j[1]]
    assert not overlaps, overlaps


def test_a_waiting_timing_lets_no_new_judge_start():
    from sandbox.device_lock import HostQuiet
    quiet, order = HostQuiet(), []
    judging, timing_waits = threading.Event(), threading.Event()

    def judge(name: str, hold: float, started: threading.Event | None = None):
        with quiet.busy():
            order.append(f"{name} starts")
            if started:
                started.set()
            time.sleep(hold)
            order.append(f"{name} ends")

    def timing():
        timing_waits.set()
        with quiet.timing():
            order.append("timing")
    first = threading.Thread(target=judge, args=("judge 1", 0.5, judging))
    first.start()
    judging.wait()
    t = threading.Thread(target=timing)
    t.start()
    timing_waits.wait()
    time.sleep(0.1)  # the timing waits for judge 1 now
    second = threading.Thread(target=judge, args=("judge 2", 0.0))
    second.start()
    for th in (first, t, second):
        th.join(timeout=10)
    assert order == ["judge 1 starts", "judge 1 ends", "timing", "judge 2 starts", "judge 2 ends"], order


def test_a_timing_waits_for_judges_before_it_takes_the_device_lock(monkeypatch):
    """A timing that waited for the tuner's judges while holding the device lock kept the GPU
    idle for every other runner (a third of a search's lock time on the H200): it waits first."""
    import contextlib
    from types import SimpleNamespace

    from sandbox import timed
    from sandbox.device_lock import HostQuiet
    lock, quiet = threading.Lock(), HostQuiet()
    runner = SimpleNamespace(device_lock=lock, host_quiet=quiet, phases={}, step=lambda _: None,
                             quiet=contextlib.nullcontext)
    held_while_timing = []
    monkeypatch.setattr(timed, "_workload",
                        lambda r, lp, i, name, budget, checks: held_while_timing.append(lock.locked()) or name)
    lp = SimpleNamespace(problem=SimpleNamespace(workloads=[SimpleNamespace(name="prefill")], is_whole_model=False))
    judging, gpu_free = threading.Event(), []

    def judge():
        with quiet.busy():
            judging.set()
            time.sleep(0.4)  # the timing below is waiting by now
            gpu_free.append(lock.acquire(blocking=False))
            if gpu_free[-1]:
                lock.release()
    j = threading.Thread(target=judge)
    j.start()
    judging.wait()
    timed_out: list = []
    t = threading.Thread(target=lambda: timed_out.extend(timed.measure(runner, lp, 10.0, [])))
    t.start()
    for th in (j, t):
        th.join(timeout=10)
    assert gpu_free == [True]  # another runner could verify while this timing waited
    assert held_while_timing == [True] and timed_out == ["prefill"]


def test_on_a_gpu_host_with_cores_to_spare_judges_run_beside_a_timing(monkeypatch):
    """On the H100 (16 cores) a search's spot-check comparisons took 0.4 s alone and 3.8 s a
    trial with the waits for timings: there the tuner's judges, kept to a quarter of the cores,
    run beside a timing. On the CPU and on a small host they still take turns."""
    import os

    import torch

    from sandbox import pool
    from sandbox.device_lock import HostQuiet
    threads = torch.get_num_threads()
    try:
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)), raising=False)
        assert pool._judges_beside_timings("cuda:0") and torch.get_num_threads() <= 4
        assert not pool._judges_beside_timings("cpu")
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(4)), raising=False)
        assert not pool._judges_beside_timings("cuda:0")
    finally:
        torch.set_num_threads(threads)
    quiet, inside = HostQuiet(overlap=True), threading.Barrier(2, timeout=5)

    def judge():
        with quiet.busy():
            inside.wait()  # broken (an exception) unless the timing is inside at once too
            time.sleep(0.3)
    j = threading.Thread(target=judge)
    j.start()
    with quiet.timing(whole_model=False):  # a region's kernels, timed on the device
        inside.wait()
    t0 = time.monotonic()
    with quiet.timing(whole_model=True):  # a whole model's time counts its host: the judge ends first
        assert time.monotonic() - t0 > 0.2 and quiet.rw.sharing == 0
    j.join(timeout=5)


def test_a_lane_that_fails_ends_the_search_with_its_error_not_a_thread_traceback(problem_dir, monkeypatch):
    """A lane's own error (the store it records a start in cannot be written: the disk is full)
    is raised where the trials are read, so the command ends with its one-line message; it was
    a thread's traceback on stderr, and the other lanes went on."""
    from agent.search.budget import Budget
    from agent.executors.local import LocalExecutor, Slot
    from agent.search.feed import Feed
    from tools.problem import StopRule
    from tools.store import StoreError
    died = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))

    def disk_full(c, generation):
        raise StoreError("trials.sqlite: cannot write (database or disk is full)")
    ex = LocalExecutor([Slot(device="cpu", generation="cpu")], [problem_dir], limits=LIMITS)
    feed = Feed(["cpu"])
    feed.put([(candidate(), "cpu", "")])
    try:
        with pytest.raises(StoreError, match="disk is full"):
            for _ in ex.run(feed, Budget(StopRule(max_candidates=5)), on_start=disk_full):
                pass
    finally:
        ex.close()
    assert died == []
