"""The parent's handle on one sandbox worker: start it (jailed, see sandbox/jail.py), ask it
things, kill it and everything it started.

Failures are values: every request returns a `Reply`, and a dead or hung worker becomes a
reply with status `crash` or `timeout` (after which the handle has killed the worker and will
start a fresh one on the next request). A reply is a claim: it must echo the request's nonce
(a frame forged ahead of time cannot), and the caller checks what it says.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import time
import weakref
from pathlib import Path
from typing import Any

from sandbox import jail, procs, protocol, zygotes
from sandbox.spawn import (_SPAWNED, _SPAWNER, Reply, WorkerConfig, _adopt, _launch, drop_spares,  # noqa: F401
                           kill_process, prestart)

ROOT = Path(__file__).resolve().parent.parent
_LIVE: "weakref.WeakSet[Worker]" = weakref.WeakSet()
"""Every worker this process has started and not yet killed (`stop_all`)."""


def stop_all(from_signal: bool = False) -> int:
    """Kill every worker this process started: a signal or an exit leaves none behind, whatever
    the code that started them was doing. The number killed. `from_signal`: called by a signal
    handler, which may have interrupted this very thread inside the spawner's or the spares'
    lock: nothing then waits for a lock (a SIGTERM during a worker's start hung the tuner on
    the spawner's), and a start under way is left to the exit's own stop_all."""
    # Fork servers first: killing one ends every worker it forked, and takes no lock.
    zygotes.stop_all()
    killed = drop_spares(blocking=not from_signal)
    for w in list(_LIVE):
        try:
            if w.alive:
                killed += 1
            w.kill()
        except Exception:  # another thread is killing it too: it goes either way
            pass
    if not from_signal:
        with contextlib.suppress(Exception):  # a start under way finishes first, so that it is seen below
            _SPAWNER.submit(lambda: None).result(timeout=30)
    for proc in _SPAWNED.copy():  # started while the signal came, not yet handed to its Worker
        if proc.poll() is None:
            killed += 1
            procs.kill_group(proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
    return killed


atexit.register(stop_all)


class Worker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.proc: subprocess.Popen | zygotes.ForkedProc | None = None
        self.sock: socket.socket | None = None
        self.hello: dict[str, Any] = {}
        self.tmpdir: str | None = None
        self.starts = 0
        self.isolation: dict[str, Any] = {}
        self.marker = ""
        self._stopped_total = 0.0
        self._stopped_since: float | None = None
        self._ns_init: tuple[subprocess.Popen, int, str] | None = None
        """(the process it was found for, the jail's first process, its pid namespace)."""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> Reply:
        """A worker for this handle: a spare started ahead for the same configuration
        (`prestart`), else a new process; then its hello."""
        self.kill()
        cfg = self.config
        t0 = time.monotonic()
        got = _adopt(cfg) or _launch(cfg)
        if isinstance(got, Reply):
            return got
        self.proc, self.sock, self.tmpdir, self.marker, self.isolation = (got.proc, got.sock, got.tmpdir,
                                                                          got.marker, got.isolation)
        _LIVE.add(self)
        zygotes.attach(self, self.proc)
        self.starts += 1
        try:
            self.hello, _ = protocol.recv(self.sock, cfg.start_timeout)
        except (protocol.ChannelTimeout, protocol.ChannelClosed) as e:
            self.proc.poll()  # a fork server that failed writes why into the worker's log
            tail = self.log_tail()
            self.kill()
            return Reply(False, status="crash", error=f"worker did not start: {e}\n{tail}")
        if not self.hello.get("ok"):
            tail = self.log_tail()
            forked = isinstance(self.proc, zygotes.ForkedProc)
            self.kill()
            error = f"{self.hello.get('error', 'worker refused to start')}\n{tail}"
            if forked and not jail.forking():  # e.g. the GPU not usable in forked namespaces: exec from now on
                jail.FORK_FAILED.append(error)
                return self.start()
            return Reply(False, status="crash", error=error)
        self.hello["isolation"] = {**self.hello.get("isolation", {}), "jail": self.isolation}
        if isinstance(self.proc, zygotes.ForkedProc):  # forked, or (CUDA in the server) forked then exec'd
            self.hello["isolation"]["start"] = self.proc.started_by()
        return Reply(True, self.hello, seconds=time.monotonic() - t0)

    def request(self, header: dict[str, Any], tensors: Any = None, timeout: float = 60.0,
                fds: list[int] | None = None) -> Reply:
        """Send one request and wait for its answer; a dead or silent worker is killed."""
        if not self.alive:
            started = self.start()
            if not started.ok:
                return started
        nonce = secrets.token_hex(8)
        t0, stopped0 = time.monotonic(), self.stopped_seconds()
        # Read once: a close on another thread (the executor's, at a stop) sets it to None.
        sock = self.sock
        try:
            if sock is None:
                raise protocol.ChannelClosed("the worker was closed")
            protocol.send(sock, {**header, "nonce": nonce}, tensors, fds=fds)
            # The time limit counts the worker's own time: seconds it spent stopped while a
            # sibling timed (TrialRunner.siblings) are added to it.
            def left() -> float:
                return t0 + timeout + self.stopped_seconds() - stopped0 - time.monotonic()
            while not _readable(sock, max(0.0, min(1.0, left()))):
                if left() <= 0:
                    raise protocol.ChannelTimeout(f"no frame within {timeout:.0f} s")
            head, payload = protocol.recv(sock, timeout)
        except protocol.ChannelTimeout:
            self.kill()
            return Reply(False, status="timeout", error=f"no answer to {header.get('op')!r} within {timeout:.0f} s",
                         seconds=time.monotonic() - t0)
        except protocol.ChannelClosed as e:
            tail = self.log_tail()  # read before the kill below removes the log
            code = self._reap()
            return Reply(False, status="crash", error=f"worker died during {header.get('op')!r}: {_exit_text(code)}"
                         f" ({e})\n{tail}", seconds=time.monotonic() - t0)
        seconds = time.monotonic() - t0
        if head.get("nonce") != nonce:
            self.kill()
            return Reply(False, status="suspicious", error=f"the reply to {header.get('op')!r} does not answer the "
                         "request (a frame written to the worker's socket by someone else)", seconds=seconds)
        if not head.get("ok"):
            if head.get("fatal"):
                self._reap()
            return Reply(False, head, payload, head.get("status", "crash"), head.get("error", ""), seconds)
        if head.get("replace_worker"):  # the worker says candidate code may still run in it
            self.kill()
        return Reply(True, head, payload, seconds=seconds)

    def members(self) -> set[int]:
        """Host pids of every process that belongs to this worker: its jail's pid namespace, or,
        without a jail, every process carrying its marker in the environment."""
        if self.proc is None:
            return set()
        if self.isolation.get("kind") == "bubblewrap":
            # Every process of a pid namespace descends from its first one (orphans are handed to
            # it), so its tree is the worker: a few files read, where a scan of /proc read two per
            # process on the machine, for every sibling stopped around every timed run.
            if self._ns_init is None or self._ns_init[0] is not self.proc:
                first, ns = procs.pid_namespace(self.proc.pid)
                if not first:
                    return set()  # bubblewrap has not made it yet
                self._ns_init = (self.proc, first, ns)
            _, first, ns = self._ns_init
            tree = procs.tree(first) if first and procs.readlink(f"/proc/{first}/ns/pid") == ns else None
            if tree is not None:
                return tree
            return {pid for pid in procs.pids() if ns and procs.readlink(f"/proc/{pid}/ns/pid") == ns}
        mark = f"NIGHTSHIFT_WORKER={self.marker}".encode()
        out = set()
        for pid in procs.pids():
            try:
                if mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    out.add(pid)
            except OSError:
                pass
        return out

    @contextlib.contextmanager
    def frozen(self):
        """Every process of this worker stopped while the block runs (SIGSTOP, then SIGCONT):
        the original is timed in the reference worker meanwhile, and a candidate idle in its own
        worker could otherwise load the machine only then, slowing the baseline it is compared
        with. Work it already queued on a GPU is beyond a signal's reach."""
        stopped: list[int] = []
        self._stopped_since = time.monotonic()
        try:
            for pid in sorted(self.members() - {os.getpid()}):
                try:
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + 0.5
            while any(not procs.stopped(pid) for pid in stopped) and time.monotonic() < deadline:
                time.sleep(0.001)
            yield
        finally:
            for pid in stopped:
                try:
                    os.kill(pid, signal.SIGCONT)
                except (ProcessLookupError, PermissionError):
                    pass
            self._stopped_total += time.monotonic() - self._stopped_since
            self._stopped_since = None

    def stopped_seconds(self) -> float:
        """Seconds this worker has spent stopped (`frozen`), the current stop included."""
        since = self._stopped_since
        return self._stopped_total + (time.monotonic() - since if since is not None else 0.0)

    def log_tail(self, n: int = 2000) -> str:
        try:
            return Path(self.tmpdir, "stdout.log").read_bytes()[-n:].decode(errors="replace")
        except (OSError, TypeError):
            return ""

    def _reap(self) -> int | None:
        code = None
        if self.proc is not None:
            try:
                code = self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        return code

    def kill(self) -> None:
        """The worker and every process it started: the jail's pid namespace dies with its
        first process; without a jail, the worker's process group and every process that
        carries its marker (a candidate's setsid grandchildren)."""
        # Read once: another thread (an interrupt, a timeout) may be killing it too, and the
        # wait for the jail to end leaves time for that.
        proc = self.proc
        if proc is not None:
            stray = self.members() if self.isolation.get("kind") != "bubblewrap" else set()
            kill_process(proc)
            for pid in stray - {os.getpid()}:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            if self.proc is proc:
                self.proc = None
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()
        tmpdir, self.tmpdir = self.tmpdir, None
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)
        _LIVE.discard(self)

    def close(self) -> None:
        sock, proc = self.sock, self.proc  # read once: a kill on another thread sets them to None
        if sock is not None and proc is not None and proc.poll() is None:
            try:
                protocol.send(sock, {"op": "exit"})
                proc.wait(timeout=5)
            except (protocol.ChannelClosed, subprocess.TimeoutExpired):
                pass
        self.kill()
        zygotes.release(self)  # its fork server ends once no open handle uses it


def _readable(sock: socket.socket, seconds: float) -> bool:
    try:
        return bool(select.select([sock], [], [], seconds)[0])
    except (ValueError, OSError) as e:  # closed under us (fileno -1) by a kill on another thread
        raise protocol.ChannelClosed(f"the worker's socket was closed: {e}") from None


def _exit_text(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
