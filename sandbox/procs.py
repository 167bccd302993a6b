"""The host's view of a worker's processes, read from /proc: the pid namespace bubblewrap made
for it, the process tree under that namespace's first process, and ending it all."""

from __future__ import annotations

import contextlib
import os
import select
import signal
from pathlib import Path


def kill_group(pid: int, timeout: float = 10.0, pidfd: int | None = None) -> None:
    """SIGKILL the process group of `pid` and, where `pid` made a pid namespace (bubblewrap's
    jail, a forked worker's setup process), that namespace's first process, then wait until it
    has ended: the kernel ends every other process of a namespace before its first one, so none
    of the jail is left. Killing bubblewrap alone left the jail to its parent-death signal, and it
    outlived the tuner's exit. With `pidfd` (a process the tuner did not start, so whose pid it
    cannot hold), that process is signalled through it instead of its group."""
    if pid <= 0:  # never killpg(0): that is the tuner's own group
        if pidfd is not None:  # a process whose pid could not be read: its namespace dies with it
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return
    first, ns = pid_namespace(pid)
    fd = None
    if first:
        with contextlib.suppress(OSError):
            fd = os.pidfd_open(first)
        if fd is not None and readlink(f"/proc/{first}/ns/pid") != ns:  # ended, its pid taken again
            os.close(fd)
            fd = None
    if pidfd is not None:
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    else:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    if fd is None:
        return
    try:
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        select.select([fd], [], [], timeout)
    finally:
        os.close(fd)


def pids() -> list[int]:
    try:
        return [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []


def stopped(pid: int) -> bool:
    """Stopped, or gone (a process that exited is not running either)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t", "Z", "X")
    except (OSError, IndexError):
        return True


def readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def pid_namespace(outer: int) -> tuple[int, str]:
    """The first process of the pid namespace bubblewrap made, and that namespace (0, "" if none yet)."""
    own = readlink(f"/proc/{outer}/ns/pid")
    kids = children(outer)
    for pid in pids() if kids is None else kids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields and int(fields[1]) == outer:
            ns = readlink(f"/proc/{pid}/ns/pid")
            if ns and ns != own:
                return pid, ns
    return 0, ""


def children(pid: int) -> list[int] | None:
    """The children of every thread of `pid` (None where the kernel has no such lists)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    kids: list[int] = []
    for tid in tids:
        try:
            kids += [int(k) for k in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except FileNotFoundError:
            if not os.path.isdir(f"/proc/{pid}/task/{tid}"):
                continue  # the thread ended meanwhile
            return None  # CONFIG_PROC_CHILDREN is off
        except (OSError, ValueError):
            continue
    return kids


def tree(root: int) -> set[int] | None:
    """`root` and every process descending from it (None where the kernel has no children lists)."""
    seen: set[int] = set()
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        kids = children(pid)
        if kids is None:
            return None
        if os.path.isdir(f"/proc/{pid}"):
            seen.add(pid)
        todo += kids
    return seen
