"""The parent's handle on one sandbox worker: start it, ask it things, kill it.

Failures are values: every request returns a `Reply`, and a dead or hung worker becomes a
reply with status `crash` or `timeout` (after which the handle has killed the process group
and will start a fresh worker on the next request).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox import protocol
from sandbox.isolation import worker_env

ROOT = Path(__file__).resolve().parent.parent
# Workers die with the thread that started them (PR_SET_PDEATHSIG follows the creating
# thread), so every worker is started from this one thread, which lives as long as the tuner.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nightshift-spawner")


@dataclass
class Reply:
    ok: bool
    header: dict[str, Any] = field(default_factory=dict)
    tensors: Any = None
    status: str = ""
    error: str = ""
    seconds: float = 0.0


@dataclass
class WorkerConfig:
    device: str = "cpu"
    """`cpu` or `cuda:N` (N is the index as the tuner sees it)."""
    start_timeout: float = 120.0
    memory_gb: float = 8.0
    """Address-space cap for CPU workers."""
    gpu_memory_fraction: float = 0.9
    triton_cache: str | None = None
    interpret: bool | None = None
    """Run Triton through its interpreter (default: when the device is the CPU)."""


class Worker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.hello: dict[str, Any] = {}
        self.workdir: str | None = None
        self.starts = 0

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> Reply:
        self.kill()
        cfg = self.config
        kind, _, index = cfg.device.partition(":")
        self.workdir = tempfile.mkdtemp(prefix="nightshift-worker-")
        env = worker_env(dict(os.environ), self.workdir, _physical(index or "0") if kind == "cuda" else None)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        if cfg.interpret if cfg.interpret is not None else kind == "cpu":
            env["TRITON_INTERPRET"] = "1"
        if cfg.triton_cache:
            env["TRITON_CACHE_DIR"] = cfg.triton_cache
        parent_sock, child_sock = socket.socketpair()
        cmd = [sys.executable, "-m", "sandbox.worker", "--fd", str(child_sock.fileno()),
               "--parent", str(os.getpid()), "--device", kind, "--memory-gb", str(cfg.memory_gb),
               "--gpu-memory-fraction", str(cfg.gpu_memory_fraction)]
        t0 = time.monotonic()
        log = open(os.path.join(self.workdir, "stdout.log"), "wb")
        self.proc = _SPAWNER.submit(subprocess.Popen, cmd, env=env, cwd=self.workdir,
                                    pass_fds=(child_sock.fileno(),), start_new_session=True,
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT).result()
        log.close()
        child_sock.close()
        self.sock = parent_sock
        self.starts += 1
        try:
            self.hello, _ = protocol.recv(self.sock, cfg.start_timeout)
        except (protocol.ChannelTimeout, protocol.ChannelClosed) as e:
            log = self.log_tail()
            self.kill()
            return Reply(False, status="crash", error=f"worker did not start: {e}\n{log}")
        if not self.hello.get("ok"):
            self.kill()
            return Reply(False, status="crash", error=self.hello.get("error", "worker refused to start"))
        return Reply(True, self.hello, seconds=time.monotonic() - t0)

    def request(self, header: dict[str, Any], tensors: Any = None, timeout: float = 60.0) -> Reply:
        """Send one request and wait for its answer; a dead or silent worker is killed."""
        if not self.alive:
            started = self.start()
            if not started.ok:
                return started
        t0 = time.monotonic()
        try:
            protocol.send(self.sock, header, tensors)
            head, payload = protocol.recv(self.sock, timeout)
        except protocol.ChannelTimeout:
            self.kill()
            return Reply(False, status="timeout", error=f"no answer to {header.get('op')!r} within {timeout:.0f} s",
                         seconds=time.monotonic() - t0)
        except protocol.ChannelClosed as e:
            code = self._reap()
            return Reply(False, status="crash", error=f"worker died during {header.get('op')!r}: {_exit_text(code)}"
                         f" ({e})\n{self.log_tail()}", seconds=time.monotonic() - t0)
        seconds = time.monotonic() - t0
        if not head.get("ok"):
            if head.get("fatal"):
                self._reap()
            return Reply(False, head, payload, head.get("status", "crash"), head.get("error", ""), seconds)
        return Reply(True, head, payload, seconds=seconds)

    def log_tail(self, n: int = 2000) -> str:
        try:
            return Path(self.workdir, "stdout.log").read_bytes()[-n:].decode(errors="replace")
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
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            self.proc = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def close(self) -> None:
        if self.alive:
            try:
                protocol.send(self.sock, {"op": "exit"})
                self.proc.wait(timeout=5)
            except (protocol.ChannelClosed, subprocess.TimeoutExpired):
                pass
        self.kill()


def _physical(index: str) -> str:
    """The physical device behind the tuner's cuda:N, honouring the tuner's CUDA_VISIBLE_DEVICES."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if int(index) < len(ids):
            return ids[int(index)]
    return index


def _exit_text(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
