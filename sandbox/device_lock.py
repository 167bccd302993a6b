"""The lock a worker holds while it verifies or times on a GPU, across every tuner of the host.

A timing holds it alone; regions' verifications share it (VERIFY_AT_ONCE of one tuner at a
time), since what a verification finds does not depend on what runs beside it. Within one tuner,
sibling workers of a device share it in-process (one times, the others compile). Two tuners
sharing a GPU (`--devices cuda:0` while another run holds it, or integration beside a search)
would otherwise time at once and each see the other's kernels in its numbers. So the lock is also an `flock` on a file per physical device, which the kernel
releases when its holder dies: a killed tuner never leaves the GPU locked (shared for a
verification, exclusive for a timing).

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
from typing import Any


def lock_dir() -> Path:
    return Path(os.environ.get("NIGHTSHIFT_LOCK_DIR") or Path(tempfile.gettempdir()) / "nightshift-devices")


def physical_device(device: str) -> str:
    """`cuda:N` as the host numbers it (CUDA_VISIBLE_DEVICES renumbers a process's GPUs)."""
    if not device.startswith("cuda"):
        return device
    index = int(device.partition(":")[2] or 0)
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return f"cuda-{visible[index] if index < len(visible) else index}"


VERIFY_AT_ONCE = 2
"""Verifications of one tuner that may hold a device at once (`DeviceLock.verifying`). A
verification's answers do not depend on what else runs, only a timing's do; two at a time, as
concurrent outputs cost device memory (7 of 122 trials of the example ran out of it on the
H100 with eight lanes that each verified alone, 2026-12-06). A whole model verifies alone
(sandbox/runner.py)."""


class SharedExclusive:
    """A readers-writer lock within one process that prefers the writer: held alone, it waits for
    the sharers under way and, while it waits, lets no new sharer start; at most `limit` share it
    at once (None: any number)."""

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self.cond = threading.Condition()
        self.sharing = 0
        self.alone = False
        self.waiting_alone = 0

    def acquire(self, alone: bool) -> None:
        with self.cond:
            if alone:
                self.waiting_alone += 1
                try:
                    while self.alone or self.sharing:
                        self.cond.wait()
                finally:
                    self.waiting_alone -= 1
                self.alone = True
                return
            while self.alone or self.waiting_alone or (self.limit is not None and self.sharing >= self.limit):
                self.cond.wait()
            self.sharing += 1

    def release(self, alone: bool) -> None:
        with self.cond:
            if alone:
                self.alone = False
            else:
                self.sharing -= 1
            self.cond.notify_all()

    def held(self) -> bool:
        return self.alone or self.sharing > 0

    @contextlib.contextmanager
    def holding(self, alone: bool):
        self.acquire(alone)
        try:
            yield
        finally:
            self.release(alone)


class DeviceLock:
    """Held exclusively (`with lock:`) while a worker times; shared (`verifying()`) while one
    verifies. A timing waits for the verifications under way and none starts while it waits."""

    def __init__(self, device: str, across_processes: bool = True):
        self.device = device
        self.path = lock_dir() / f"{physical_device(device).replace(':', '-')}.lock"
        self.rw = SharedExclusive(limit=VERIFY_AT_ONCE)
        self.fd: int | None = None
        self.shared = across_processes
        try:
            if self.shared and not self.path.parent.is_dir():
                self.path.parent.mkdir(parents=True, exist_ok=True)
                os.chmod(self.path.parent, 0o1777)  # every user's tuners lock the same files
        except OSError:
            self.shared = False

    def _flock(self, how: int) -> int | None:
        """This acquisition's own open file, flocked (None where files cannot be locked)."""
        if not self.shared:
            return None
        fd = None
        try:
            # Opened per acquisition: flock belongs to an open file, so two locks of one process
            # (integration beside a search) exclude each other as two processes do.
            # (read-only: a file another user created can still be locked)
            fd = os.open(self.path, os.O_RDONLY | os.O_CREAT, 0o644)
            fcntl.flock(fd, how)
            return fd
        except OSError:
            if fd is not None:
                os.close(fd)
            self.shared = False
            return None

    @staticmethod
    def _unflock(fd: int | None) -> None:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> "DeviceLock":
        self.rw.acquire(alone=True)
        try:
            self.fd = self._flock(fcntl.LOCK_EX)
        except BaseException:
            self.rw.release(alone=True)
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._unflock(self.fd)
        self.fd = None
        self.rw.release(alone=True)

    def locked(self) -> bool:
        """Held by a timing or a verification."""
        return self.rw.held()

    @contextlib.contextmanager
    def verifying(self):
        with self.rw.holding(alone=False):
            fd = self._flock(fcntl.LOCK_SH)
            try:
                yield self
            finally:
                self._unflock(fd)


def verifying(lock: Any, whole_model: bool = False):
    """How a verification holds `lock`: shared where the lock is a DeviceLock, but for a whole
    model's, which holds the most device memory (a KV cache's gigabytes) and takes it alone (a
    compile baseline lost to memory would leave the report without its rival); other locks
    (tests' plain ones) whole."""
    return lock.verifying() if isinstance(lock, DeviceLock) and not whole_model else lock


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
        self.rw = SharedExclusive()

    def busy(self):
        return self.rw.holding(alone=False)

    @contextlib.contextmanager
    def timing(self, whole_model: bool = True):
        if self.overlap and not whole_model:
            yield
            return
        with self.rw.holding(alone=True):
            yield
