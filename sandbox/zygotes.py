"""The tuner's side of the fork servers (sandbox/forkserver.py): one per worker configuration,
keyed by what its jail and environment are made of, started on first need, each asked to fork
the workers of its configuration.

A worker forked this way is a `ForkedProc`: what `subprocess.Popen` is to a worker started
afresh (pid, poll, wait), read from a pidfd of the worker's setup process and a status pipe that
the worker's init writes its wait status into. Killing it kills its namespace's init through
that process's tree (sandbox/procs.py), which ends every process of the worker, whatever it
ignores or forks. A fork server ends when the last handle that used it is closed and none of its
workers is alive, when `stop_all` runs (exit, signals), or with the tuner (its jail dies with it);
its workers die with it. Its folder on the host goes with it, or, where the tuner was killed
with SIGKILL, with the next tuner's first server (`sweep`).

Requests never wait for the fork server's imports: a request is queued on its socket and its
answer (the pidfd) read when the worker's pid is first needed, so workers started ahead of need
(`prestart`) cost the tuner nothing while the model is profiled.
"""

from __future__ import annotations

import collections
import os
import select
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Callable

from sandbox import procs, protocol

SERVER_FOLDER_BYTES = 64 << 20
"""The fork server's own jail folder (a tmpfs): it writes nothing there; each worker gets its own."""
FOLDER_PREFIX = "nightshift-forkserver-"
"""Each server's folder on the host (its log) is named `FOLDER_PREFIX<tuner pid>-...`."""


class Zygote:
    """One fork server: its process (bubblewrap's), its socket, the requests not yet answered."""

    def __init__(self, key: tuple, proc: subprocess.Popen, sock: socket.socket, tmpdir: str):
        self.key, self.proc, self.sock, self.tmpdir = key, proc, sock, tmpdir
        self.send_lock, self.recv_lock = threading.Lock(), threading.Lock()
        self.waiting: collections.deque[ForkedProc] = collections.deque()
        self.forked: "weakref.WeakSet[ForkedProc]" = weakref.WeakSet()
        self.handles: "weakref.WeakSet[object]" = weakref.WeakSet()
        self.ended = ""

    def request(self, header: dict, fds: list[int], tmpdir: str) -> ForkedProc:
        """Queue a fork; the answer is read later (`settle`)."""
        r, w = os.pipe()
        fp = ForkedProc(self, r, tmpdir)
        with self.send_lock:
            self.waiting.append(fp)  # before the send: the answer may come before append would
            try:
                if self.ended:
                    raise protocol.ChannelClosed(self.ended)
                protocol.send(self.sock, {"op": "fork", **header}, fds=[*fds, w])
            except protocol.ChannelClosed as e:
                self.fail(f"the fork server is gone: {e}")
            finally:
                os.close(w)
        self.forked.add(fp)
        return fp

    def settle(self, target: ForkedProc, timeout: float) -> None:
        """Read answers, in the order of the requests, until `target` has its own or `timeout`
        passes (0: only what has arrived; never waits for a lock then)."""
        got = self.recv_lock.acquire(blocking=False) if timeout <= 0 else self.recv_lock.acquire(timeout=timeout)
        if not got:
            return
        try:
            deadline = time.monotonic() + timeout
            while not target.answered and self.waiting:
                try:
                    ready = select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))[0]
                except (OSError, ValueError):  # its socket closed: the server was ended
                    ready = []
                if not ready:
                    if self.proc.poll() is not None or self.sock.fileno() < 0:
                        self.fail(f"the fork server ended ({self.proc.returncode})")
                    return
                try:
                    head, _ = protocol.recv(self.sock, 30, accept_fds=True)
                except (protocol.ChannelClosed, protocol.ChannelTimeout) as e:
                    self.fail(f"the fork server ended: {e}")
                    return
                self.waiting.popleft().answer(head)
        finally:
            self.recv_lock.release()

    def fail(self, why: str) -> None:
        """The server is gone: every request it did not answer is a worker that never started."""
        self.ended = self.ended or why
        tail = self.log_tail()
        while self.waiting:
            try:
                self.waiting.popleft().answer({"ok": False, "error": f"{why}\n{tail}"})
            except IndexError:
                return

    def log_tail(self, n: int = 2000) -> str:
        try:
            return Path(self.tmpdir, "stdout.log").read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def live(self) -> bool:
        return any(fp.poll() is None for fp in list(self.forked))

    def end(self) -> None:
        """Kill the server (and so any worker it forked: they live in its jail's pid namespace)."""
        self.ended = self.ended or "ended"
        procs.kill_group(self.proc.pid)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.sock.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


class ForkedProc:
    """A forked worker as the tuner sees it; the parts of `subprocess.Popen` the handles use."""

    def __init__(self, zygote: Zygote, status_fd: int, tmpdir: str):
        self.zygote, self.status_fd, self.tmpdir = zygote, status_fd, tmpdir
        self.answered, self.pidfd, self._pid, self.returncode = False, None, 0, None
        self.mode, self.cancelled = "", False
        self.lock = threading.Lock()  # a kill and a poll from two threads: one closes the descriptors

    def answer(self, head: dict) -> None:
        fds = head.get("_fds") or []
        if head.get("ok") and len(fds) == 1:
            self.pidfd, self.mode = fds[0], str(head.get("mode", ""))
            self._pid = _host_pid(self.pidfd)
            self.answered = True  # last: a thread that sees it answered finds the pidfd there
            if self.cancelled:
                self.kill_all()
            return
        for fd in fds:
            os.close(fd)
        try:  # the reason reaches the worker's log, which the failed start shows
            with open(Path(self.tmpdir, "stdout.log"), "a") as f:
                f.write(f"the fork server did not fork this worker: {head.get('error', '?')}\n")
        except OSError:
            pass
        self._ended(-9)
        self.answered = True

    @property
    def pid(self) -> int:
        """The host pid of the worker's setup process (its namespace's init is its child); 0 until
        the fork server has answered (waits up to 10 s for that)."""
        if not self.answered:
            self.zygote.settle(self, 10.0)
        return self._pid

    def started_by(self) -> str:
        """How the server made this worker: forked, or forked then exec'd (CUDA in the server)."""
        return f"by a fork server ({self.mode or 'no answer yet'})" if self.pid else "by a fork server (no answer)"

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if not self.answered:
            self.zygote.settle(self, 0.0)
            if not self.answered:
                return None
        with self.lock:
            if self.pidfd is not None and select.select([self.pidfd], [], [], 0)[0]:
                self._ended(self._status())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.answered:
            self.zygote.settle(self, 3600.0 if timeout is None else timeout)
        while self.poll() is None:
            left, fd = None if deadline is None else deadline - time.monotonic(), self.pidfd
            if left is not None and left <= 0 or fd is None:
                raise subprocess.TimeoutExpired("forked worker", timeout or 0)
            try:
                select.select([fd], [], [], left)
            except (OSError, ValueError):  # closed by another thread's poll: the next poll says how it ended
                pass
        return self.returncode

    def kill_all(self, blocking: bool = True) -> None:
        """Kill the worker and every process in its namespace, and wait until they are gone. A
        worker the server has not forked yet (still importing) is marked: it is killed when its
        answer is read, and its socket, closed by the handle, ends it at its first word."""
        if self.returncode is not None:
            return
        if self.zygote.proc.poll() is not None:  # its namespace died with the server's jail
            self._ended(-9)
            return
        if not self.answered:
            self.zygote.settle(self, 5.0 if blocking else 0.0)
        if not self.answered:
            self.cancelled = True
            return
        with self.lock:
            if self.pidfd is not None and not select.select([self.pidfd], [], [], 0)[0]:
                procs.kill_group(self._pid, pidfd=self.pidfd)

    def _status(self) -> int:
        """The worker's exit as Popen gives it: the init's report, or SIGKILL where the init was
        killed before it could write one."""
        try:
            data = os.read(self.status_fd, 4)
        except OSError:
            data = b""
        return os.waitstatus_to_exitcode(struct.unpack("!i", data)[0]) if len(data) == 4 else -9

    def _ended(self, code: int) -> None:
        self.returncode = code
        for fd in (self.pidfd, self.status_fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.pidfd = self.status_fd = None


def _host_pid(pidfd: int) -> int:
    """The pid, in the tuner's namespace, of the process a pidfd names (fdinfo's Pid field)."""
    try:
        for line in Path(f"/proc/self/fdinfo/{pidfd}").read_text().splitlines():
            if line.startswith("Pid:"):
                return max(0, int(line.split()[1]))
    except (OSError, ValueError, IndexError):
        pass
    return 0


_ZYGOTES: dict[tuple, Zygote] = {}
_LOCK = threading.Lock()


def fork(key: tuple, start: Callable[[int, str], subprocess.Popen], header: dict, fds: list[int],
         tmpdir: str) -> ForkedProc:
    """A worker forked by the fork server of `key`, started now (`start(fd, its folder)`) if none
    is running; `fds`: the worker's socket and log (the status pipe is added here)."""
    release()  # servers whose handles went without closing them, and no worker alive
    with _LOCK:
        z = _ZYGOTES.get(key)
        if z is not None and (z.ended or z.proc.poll() is not None):
            _ZYGOTES.pop(key, None)
            z.end()
            z = None
        if z is None:
            sweep()
            folder = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-")
            ours, theirs = socket.socketpair()
            try:
                proc = start(theirs.fileno(), folder)
            except OSError:
                ours.close()
                shutil.rmtree(folder, ignore_errors=True)
                raise
            finally:
                theirs.close()
            z = _ZYGOTES[key] = Zygote(key, proc, ours, folder)
        return z.request(header, fds, tmpdir)  # under the lock: a server is never idle between its start and this


def attach(handle: object, proc: object) -> None:
    """`handle` uses the fork server that forked `proc` (it ends only once no handle does)."""
    if isinstance(proc, ForkedProc):
        proc.zygote.handles.add(handle)


def release(handle: object | None = None) -> int:
    """`handle` is done with its fork server; end every server no open handle uses and with no
    worker alive. The number ended."""
    with _LOCK:
        for z in _ZYGOTES.values():
            if handle is not None:
                z.handles.discard(handle)
        idle = [k for k, z in _ZYGOTES.items() if not z.handles and not z.live()]
        ending = [_ZYGOTES.pop(k) for k in idle]
    for z in ending:
        z.end()
    return len(ending)


def stop_all() -> int:
    """Kill every fork server, and so every worker forked from one; takes no lock (a signal's
    handler may have interrupted a thread holding one)."""
    servers: list[Zygote] = []
    for _ in range(3):  # read without the lock: a thread that held it may be adding one
        try:
            servers = list(_ZYGOTES.values())
            break
        except RuntimeError:
            continue
    for z in servers:
        z.ended = z.ended or "stopped"
        procs.kill_group(z.proc.pid)
        shutil.rmtree(z.tmpdir, ignore_errors=True)
    return len(servers)


def sweep(folder: str | None = None) -> int:
    """Remove the server folders of tuners that are gone (killed with SIGKILL, their exit never
    ran); the number removed. A folder whose tuner is alive, or that is not ours, stays."""
    removed = 0
    for path in Path(folder or tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}*-*"):
        pid = path.name[len(FOLDER_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or another user's: not ours to remove)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed += 1
    return removed


def running() -> int:
    return sum(1 for z in list(_ZYGOTES.values()) if z.proc.poll() is None)
