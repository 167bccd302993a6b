"""The lock a worker holds while it verifies or times on a GPU, across every tuner of the host.

Within one tuner, sibling workers of a device share a thread lock (one times, the others
compile). Two tuners sharing a GPU (`--devices cuda:0` while another run holds it, or
integration beside a search) would otherwise time at once and each see the other's kernels in
its numbers. So the lock is also an `flock` on a file per physical device, which the kernel
releases when its holder dies: a killed tuner never leaves the GPU locked.

The files live in NIGHTSHIFT_LOCK_DIR (default: a folder under the system's temporary folder,
shared by every user of the host). Where no such file can be opened, the lock holds within
this tuner only, and `shared` says so.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
from pathlib import Path


def lock_dir() -> Path:
    return Path(os.environ.get("NIGHTSHIFT_LOCK_DIR") or Path(tempfile.gettempdir()) / "nightshift-devices")


def physical_device(device: str) -> str:
    """`cuda:N` as the host numbers it (CUDA_VISIBLE_DEVICES renumbers a process's GPUs)."""
    if not device.startswith("cuda"):
        return device
    index = int(device.partition(":")[2] or 0)
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return f"cuda-{visible[index] if index < len(visible) else index}"


class DeviceLock:
    def __init__(self, device: str):
        self.device = device
        self.path = lock_dir() / f"{physical_device(device).replace(':', '-')}.lock"
        self.threads = threading.Lock()
        self.fd: int | None = None
        self.shared = True
        try:
            if not self.path.parent.is_dir():
                self.path.parent.mkdir(parents=True, exist_ok=True)
                os.chmod(self.path.parent, 0o1777)  # every user's tuners lock the same files
        except OSError:
            self.shared = False

    def __enter__(self) -> "DeviceLock":
        self.threads.acquire()
        if not self.shared:
            return self
        try:
            # Opened per acquisition: flock belongs to an open file, so two locks of one process
            # (integration beside a search) exclude each other as two processes do.
            # (read-only: a file another user created can still be locked)
            self.fd = os.open(self.path, os.O_RDONLY | os.O_CREAT, 0o644)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError:
            if self.fd is not None:
                os.close(self.fd)
            self.fd, self.shared = None, False
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
        self.threads.release()


class HostQuiet:
    """A timing against the tuner's own heavy CPU work beside it: judging a trial's outputs runs
    outside the device lock (CPU work, on every core torch has), and while another runner timed a
    host-bound model, it took that worker's cores. An exclusive timing holds it alone (`timing`);
    judges share it (`busy`), wait while an exclusive timing runs, and one waiting lets no new
    judge start. Every timing is exclusive, unless `overlap` (a GPU host with cores to spare, the
    judges kept to a share of them, sandbox/pool.py): there only a whole model's is, whose time
    includes its host's launches; a region's kernels are timed on the device beside the judges.
    The waits had cost a search on the H100 a fifth of its lanes' time (spot-check comparisons
    0.4 s a trial alone, 3.8 s with the waits, 2026-12-06)."""

    def __init__(self, overlap: bool = False):
        self.overlap = overlap
        self.cond = threading.Condition()
        self.judging = 0
        self.timing_now = False
        self.timings_waiting = 0

    @contextlib.contextmanager
    def busy(self):
        with self.cond:
            while self.timing_now or self.timings_waiting:
                self.cond.wait()
            self.judging += 1
        try:
            yield
        finally:
            with self.cond:
                self.judging -= 1
                self.cond.notify_all()

    @contextlib.contextmanager
    def timing(self, whole_model: bool = True):
        if self.overlap and not whole_model:
            yield
            return
        with self.cond:
            self.timings_waiting += 1
            try:
                while self.timing_now or self.judging:
                    self.cond.wait()
            finally:
                self.timings_waiting -= 1
            self.timing_now = True
        try:
            yield
        finally:
            with self.cond:
                self.timing_now = False
                self.cond.notify_all()
