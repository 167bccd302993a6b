"""Starting worker processes: each from one spawner thread, each jailed (sandbox/jail.py),
and, ahead of need, as spares a handle of the same configuration adopts (`prestart`)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox import jail, procs, zygotes
from sandbox.isolation import worker_env

ROOT = Path(__file__).resolve().parent.parent
# Workers die with the thread that started them (PR_SET_PDEATHSIG follows the creating
# thread), so every worker is started from this one thread, which lives as long as the tuner.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nightshift-spawner")
# Its thread starts now, not inside a later submit that a signal may cut short: a thread started
# there but not yet registered is never told to end, and the interpreter's exit waited for it.
_SPAWNER.submit(lambda: None).result()
_SPAWNED: "set[subprocess.Popen]" = set()
"""Every worker process, from the moment it exists: a signal can come before its Worker holds it.
Held here until it has ended (a weak set lost the one whose start a SIGTERM cut short: nothing
else held it, and it outlived the tuner)."""


def _spawn(argv: list[str], **kwargs: Any) -> subprocess.Popen:
    for ended in [p for p in _SPAWNED.copy() if p.returncode is not None]:
        _SPAWNED.discard(ended)
    proc = subprocess.Popen(argv, **kwargs)
    _SPAWNED.add(proc)
    return proc


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
    role: str = "candidate"
    """`candidate` (runs candidate code) or `reference` (never does: baselines and references)."""
    start_timeout: float = 120.0
    memory_gb: float = 8.0
    """Address-space cap for CPU workers."""
    gpu_memory_fraction: float = 0.9
    interpret: bool | None = None
    """Run Triton through its interpreter (default: when the device is the CPU)."""
    hide: list[str] = field(default_factory=list)
    """Folders the worker must never see (the run folder): hidden by the jail."""
    model_files: list[str] = field(default_factory=list)
    """Model files the worker imports: their folders stay visible, read-only."""
    compile_threads: int | None = None
    """Inductor's compile threads (TORCHINDUCTOR_COMPILE_THREADS; None: its own choice). The
    search's workers use 1: a torch.compile candidate then compiles in the worker's process and
    starts no process pool, which outlived its trial and so ended its worker (9 workers replaced,
    25-75 s each, in a 50-trial tune on the H200)."""
    compile_cache: str | None = None
    """A host folder, bound writable into the jail, that holds Inductor's and Triton's caches
    instead of the worker's own empty ones (agent/review/ways.py: a compile baseline fills its mode's,
    a way with our kernels starts from a copy of it). None: the worker's own, gone with it."""
    compile_cache_at: str | None = None
    """Where the jailed worker sees `compile_cache` (None: at its own path). A copy of a baseline's
    cache is seen at the baseline's path: Triton's and Inductor's files name each other by
    absolute path, which must lead into the copy, never to the baseline's folder (hidden there)."""
    nice: int = 0
    """How much lower the worker's CPU priority is than the tuner's (started under `nice -n`: the
    jail and every process the worker starts inherit it): the compile baselines beside the
    search (agent/review/early_baselines.py)."""


@dataclass
class _Launched:
    """A worker process started (or forked), its hello not yet read."""
    proc: "subprocess.Popen | zygotes.ForkedProc"
    sock: socket.socket
    tmpdir: str
    marker: str
    isolation: dict
    device: str


def _launch(cfg: WorkerConfig) -> "_Launched | Reply":
    kind, _, index = cfg.device.partition(":")
    # The tuner's side of the worker's files (its log). Inside the jail the worker has a
    # tmpfs of its own; without a jail this folder is its working folder too.
    tmpdir = tempfile.mkdtemp(prefix="nightshift-worker-")
    preload = [a for m in cfg.model_files for a in ("--preload", m)]
    cmd = [sys.executable, "-m", "sandbox.worker", "--parent", str(os.getpid()), "--device", kind,
           "--role", cfg.role, "--memory-gb", str(cfg.memory_gb),
           "--gpu-memory-fraction", str(cfg.gpu_memory_fraction)] + preload
    where = dict(hide=[Path(h) for h in cfg.hide], model_files=[Path(m) for m in cfg.model_files], gpu=kind == "cuda",
                 writable=[(cfg.compile_cache, cfg.compile_cache_at or cfg.compile_cache)] if cfg.compile_cache else [])
    argv, iso, inside = jail.wrap(cmd, **where, folder_bytes=jail.folder_bytes(cfg.memory_gb))
    if cfg.role == "candidate" and iso.kind != "bubblewrap" and os.environ.get("NIGHTSHIFT_REQUIRE_JAIL") == "1":
        shutil.rmtree(tmpdir, ignore_errors=True)
        return Reply(False, status="crash", error=f"NIGHTSHIFT_REQUIRE_JAIL=1 and no jail: {iso.note}")
    workdir = inside or tmpdir
    env = worker_env(dict(os.environ), workdir, _physical(index or "0") if kind == "cuda" else None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if cfg.interpret if cfg.interpret is not None else kind == "cpu":
        env["TRITON_INTERPRET"] = "1"
    env.pop("TRITON_CACHE_DIR", None)  # a cache shared between workers could be poisoned
    if cfg.compile_cache:  # Triton's goes inside Inductor's (cache_dir()/triton) when unset
        env["TORCHINDUCTOR_CACHE_DIR"] = (cfg.compile_cache_at or cfg.compile_cache) if inside else cfg.compile_cache
    if cfg.compile_threads:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(cfg.compile_threads)
    nice = [shutil.which("nice") or "nice", "-n", str(cfg.nice)] if cfg.nice > 0 and shutil.which("nice") else []
    # (the jail's processes and all they start run under `nice`, the fork server's too)
    marker = secrets.token_hex(8)
    parent_sock, child_sock = socket.socketpair()
    log = open(os.path.join(tmpdir, "stdout.log"), "wb")
    try:
        if inside and not jail.forking():
            proc = _fork(cfg, kind, preload, where, nice, env, marker, [child_sock.fileno(), log.fileno()], tmpdir)
        else:
            argv = nice + argv + ["--fd", str(child_sock.fileno())] + (["--jailed"] if inside else [])
            proc = _SPAWNER.submit(_spawn, argv, env={**env, "NIGHTSHIFT_WORKER": marker}, cwd=tmpdir,
                                   pass_fds=(child_sock.fileno(),), start_new_session=True, stdin=subprocess.DEVNULL,
                                   stdout=log, stderr=subprocess.STDOUT).result()
    except OSError as e:
        parent_sock.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
        return Reply(False, status="crash", error=f"worker could not be started: {e}")
    finally:
        log.close()
        child_sock.close()
    return _Launched(proc, parent_sock, tmpdir, marker, iso.as_dict(), cfg.device)


def _fork(cfg: WorkerConfig, kind: str, preload: list[str], where: dict, nice: list[str], env: dict[str, str],
          marker: str, fds: list[int], tmpdir: str) -> zygotes.ForkedProc:
    """A worker forked by the fork server of its configuration (sandbox/forkserver.py): the same
    jail, the same environment (the key: what either is made of), started now if none runs."""
    keep = [p for c in ([cfg.compile_cache_at or cfg.compile_cache] if cfg.compile_cache else [])
            for p in {os.path.abspath(c), os.path.realpath(c)}]
    server = [sys.executable, "-m", "sandbox.forkserver", "--parent", str(os.getpid()), "--device", kind,
              "--jailed"] + preload + [a for p in keep for a in ("--keep-writable", p)] + \
        (["--exec-workers"] if os.environ.get(jail.FORK_ENV) == "exec" else [])
    argv = nice + jail.wrap(server, **where, folder_bytes=zygotes.SERVER_FOLDER_BYTES, fork_server=True)[0]

    def start(fd: int, folder: str) -> subprocess.Popen:
        with open(os.path.join(folder, "stdout.log"), "wb") as log:
            return _SPAWNER.submit(_spawn, argv + ["--fd", str(fd)], env={**env, "NIGHTSHIFT_WORKER": "fork-server"},
                                   cwd=folder, pass_fds=(fd,), start_new_session=True, stdin=subprocess.DEVNULL,
                                   stdout=log, stderr=subprocess.STDOUT).result()
    header = {"role": cfg.role, "memory_gb": cfg.memory_gb, "gpu_memory_fraction": cfg.gpu_memory_fraction,
              "marker": marker, "folder_bytes": jail.folder_bytes(cfg.memory_gb)}
    return zygotes.fork((tuple(argv), tuple(sorted(env.items()))), start, header, fds, tmpdir)


def kill_process(proc: "subprocess.Popen | zygotes.ForkedProc") -> None:
    """Kill a worker's process and every process of its jail (procs.kill_group)."""
    if isinstance(proc, zygotes.ForkedProc):
        proc.kill_all()
    else:
        procs.kill_group(proc.pid)


_SPARES: dict[tuple, list[_Launched]] = {}
_SPARES_LOCK = threading.Lock()


def _key(cfg: WorkerConfig) -> tuple:
    return (cfg.device, cfg.role, cfg.memory_gb, cfg.gpu_memory_fraction, cfg.interpret,
            tuple(sorted(cfg.hide)), tuple(sorted(cfg.model_files)), cfg.compile_threads, cfg.compile_cache,
            cfg.compile_cache_at, cfg.nice)


def prestart(configs: list[WorkerConfig]) -> int:
    """Start a worker for each configuration now, before anything asks for one: a later
    `Worker.start` with the same configuration adopts it, hello and all. A worker's start
    (imports, the device, the jail) was 30 of the 41 s to a tune's first trial on the H200;
    started while the model is profiled and frozen, it is ready when the search begins. Each
    spare is an ordinary worker, killed by `drop_spares` or at exit. The number started."""
    started = 0
    for cfg in configs:
        got = _launch(cfg)
        if isinstance(got, _Launched):
            with _SPARES_LOCK:
                _SPARES.setdefault(_key(cfg), []).append(got)
            started += 1
    return started


def _adopt(cfg: WorkerConfig) -> _Launched | None:
    with _SPARES_LOCK:
        waiting = _SPARES.get(_key(cfg), [])
        while waiting:
            spare = waiting.pop(0)
            forked_in_vain = jail.FORK_FAILED and isinstance(spare.proc, zygotes.ForkedProc)
            if spare.proc.poll() is None and not forked_in_vain:
                return spare
            _end(spare)
    return None


def spares_on(device: str) -> int:
    """Spares started for `device` and not yet adopted, alive."""
    with _SPARES_LOCK:
        return sum(1 for waiting in _SPARES.values() for s in waiting
                   if s.device == device and s.proc.poll() is None)


def drop_spares(blocking: bool = True) -> int:
    """Kill every spare no handle adopted; the number killed. Not `blocking` (a signal handler):
    where the lock is held (by the thread the signal interrupted) the spares are killed from a
    copy and left listed, for the next drop_spares to clear."""
    if not _SPARES_LOCK.acquire(blocking):
        with contextlib.suppress(RuntimeError):  # changed while copied: the next call gets them
            spares = [s for waiting in list(_SPARES.values()) for s in list(waiting)]
            for s in spares:
                _end(s)
            return len(spares)
        return 0
    try:
        spares = [s for waiting in _SPARES.values() for s in waiting]
        _SPARES.clear()
    finally:
        _SPARES_LOCK.release()
    for s in spares:
        _end(s)
    if blocking:
        zygotes.release()  # a fork server started for spares alone ends with them
    return len(spares)


def _end(spare: _Launched) -> None:
    kill_process(spare.proc)
    with contextlib.suppress(subprocess.TimeoutExpired):
        spare.proc.wait(timeout=10)
    spare.sock.close()
    shutil.rmtree(spare.tmpdir, ignore_errors=True)


def _physical(index: str) -> str:
    """The physical device behind the tuner's cuda:N, honouring the tuner's CUDA_VISIBLE_DEVICES."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if int(index) < len(ids):
            return ids[int(index)]
    return index
