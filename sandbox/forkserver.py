"""The fork server: one per worker configuration, started in the jail exactly as a worker is
(sandbox/jail.py, the same bubblewrap command line but for the capabilities below), that imports
torch and the harness once (Triton before its first candidate worker) and then forks a worker for
each request of the tuner (sandbox/zygotes.py is the tuner's side).

    python -m sandbox.forkserver --fd N --parent PID --device cpu|cuda --jailed [--preload F] [--keep-writable P]

It never runs candidate code, never imports a candidate, never initialises CUDA (a worker does,
after its fork), and reads nothing but the tuner's requests on its socket. To give each worker
namespaces of its own it keeps, inside its jail, what bubblewrap itself holds while it builds one:
CAP_SYS_ADMIN, CAP_NET_ADMIN (the loopback), CAP_SETPCAP (the bounding set), and as root
CAP_SETUID/CAP_SETGID; every worker drops them all before any candidate code (sandbox/namespaces.py).

A request carries the worker's socket, its log and the write end of a status pipe (SCM_RIGHTS),
and the worker's role and memory. The server forks the setup process (new namespaces and
mounts), which forks the namespace's init (its /proc), which forks the worker; the init writes
the worker's wait status into the status pipe when it ends, and the tuner reads it there. The
reply carries a pidfd of the setup process: the tuner kills the namespace's init through its
tree, as it kills a bubblewrap jail (sandbox/procs.py). Where the server itself imported CUDA's
state (a model file's library did, at preload), a fork would inherit a CUDA it cannot use: its
workers then exec a fresh `python -m sandbox.worker` in their new namespaces instead.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import struct
import sys
import time
import warnings

from sandbox import namespaces

WORKDIR = "/tmp/ns-worker"


def main() -> None:
    if sys.argv[1:] == ["--probe"]:  # before torch: a probe costs a bare interpreter's start
        sys.exit(probe())
    from sandbox.worker import arguments  # torch, the harness: the imports every worker shares
    ap = arguments()
    ap.add_argument("--keep-writable", action="append", default=[])
    ap.add_argument("--exec-workers", action="store_true", help="each forked worker execs a fresh interpreter")
    args = ap.parse_args()
    import gc

    import torch
    import torch.utils.deterministic  # noqa: F401
    from sandbox import protocol
    from tools.modelfile import preload_imports
    for path in args.preload:
        try:
            with open(path, encoding="utf-8") as f:
                preload_imports(f.read(), os.path.dirname(path))
        except OSError:
            continue
    # A CUDA initialised here (or its driver loaded, by a library's import) would be unusable in
    # every forked worker: they exec a fresh interpreter then, in their own namespaces all the same.
    with open("/proc/self/maps") as f:
        driver = "libcuda.so" in f.read()
    mode = "fork then exec (asked: NIGHTSHIFT_FORK_WORKERS=exec)" if args.exec_workers else \
        "fork then exec (CUDA initialised in the fork server by a preloaded library)" if torch.cuda.is_initialized() \
        else "fork then exec (CUDA's driver loaded in the fork server by a preloaded library)" if driver else "fork"
    gc.freeze()  # the imported objects stay put: a worker's collections do not copy their pages
    ctl = socket.socket(fileno=args.fd)
    serve(ctl, args, mode, protocol)


def _import_triton() -> None:
    """Triton, before the first candidate worker's fork (a reference worker runs no kernel of
    ours: a server that forks only those never pays its import, as a reference worker never did)."""
    if "triton" not in sys.modules:
        import gc
        try:
            import triton  # noqa: F401
        except Exception:  # the worker reports it as unavailable
            pass
        gc.freeze()


def serve(ctl: socket.socket, args, mode: str, protocol) -> None:
    """Requests until the tuner closes the socket; the children reaped as they end."""
    while True:
        _reap()
        if not select.select([ctl], [], [], 1.0)[0]:
            continue
        try:
            req, _ = protocol.recv(ctl, timeout=30, accept_fds=True)
        except (protocol.ChannelClosed, protocol.ChannelTimeout):
            return
        fds = req.get("_fds") or []
        if req.get("op") != "fork":
            for fd in fds:
                os.close(fd)
            return
        if req.get("role") == "candidate" and mode == "fork":
            _import_triton()
        reply, pidfd = fork_worker(req, fds, ctl, args, mode)
        for fd in fds:
            os.close(fd)
        try:
            protocol.send(ctl, reply, fds=[pidfd] if pidfd is not None else None)
        except protocol.ChannelClosed:
            return
        finally:
            if pidfd is not None:
                os.close(pidfd)


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def fork_worker(req: dict, fds: list[int], ctl: socket.socket, args, mode: str) -> tuple[dict, int | None]:
    """Fork the setup process for one worker; (the reply, a pidfd of that process)."""
    if len(fds) != 3:
        return {"ok": False, "error": f"a fork request carries 3 descriptors, not {len(fds)}"}, None
    with warnings.catch_warnings():  # 3.12 warns of threads: OpenBLAS's idle pool, which forks cleanly
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        code = 70
        try:
            code = _setup(req, *fds, ctl.fileno(), args, mode)
        except BaseException as e:  # the error goes to the worker's log and socket; nothing returns to the server
            _refuse(fds[0], f"the worker's isolation failed: {type(e).__name__}: {e}")
        finally:
            os._exit(code)
    try:
        return {"ok": True, "pid": pid, "mode": mode}, os.pidfd_open(pid)
    except OSError as e:
        os.kill(pid, signal.SIGKILL)
        return {"ok": False, "error": f"no pidfd for the forked worker: {e}"}, None


def _refuse(sock_fd: int, error: str) -> None:
    """The worker's hello, saying it will not run (the tuner shows it as the start's failure)."""
    print(error, file=sys.stderr, flush=True)
    try:
        from sandbox import protocol
        protocol.send(socket.socket(fileno=os.dup(sock_fd)), {"op": "hello", "ok": False, "error": error})
    except Exception:
        pass


def _close_all_but(keep: set[int]) -> None:
    """The fork server's descriptors (its socket to the tuner above all) never reach a worker."""
    for fd in sorted(int(f) for f in os.listdir("/proc/self/fd") if f.isdigit()):
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _setup(req: dict, sock_fd: int, log_fd: int, status_fd: int, ctl_fd: int, args, mode: str) -> int:
    """The setup process: namespaces and mounts, then the init, which it waits for."""
    t0 = time.perf_counter()
    os.close(ctl_fd)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    _close_all_but({0, 1, 2, sock_fd, status_fd})
    namespaces.die_with_parent()
    namespaces.enter_worker_namespaces(WORKDIR, int(req["folder_bytes"]), list(args.keep_writable))
    init = os.fork()
    if init == 0:
        code = 71
        try:
            code = _init(req, sock_fd, status_fd, args, mode, t0)
        except BaseException as e:
            _refuse(sock_fd, f"the worker's isolation failed: {type(e).__name__}: {e}")
        finally:
            os._exit(code)
    os.close(sock_fd)
    os.close(status_fd)
    os.waitpid(init, 0)  # its namespace is gone when it is: nothing of the worker outlives this process
    return 0


def _init(req: dict, sock_fd: int, status_fd: int, args, mode: str, t0: float) -> int:
    """Pid 1 of the worker's namespace: its /proc, then the worker; reaps every orphan, and when
    the worker ends writes its wait status for the tuner and ends the namespace with it."""
    namespaces.die_with_parent()
    # Pid 1 gets no signal it has no handler for from inside its namespace: a candidate's SIGINT
    # to its parent is dropped, as bubblewrap's init drops it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    namespaces.mount_own_proc()
    namespaces.prctl(namespaces.PR_SET_DUMPABLE, 0)  # the worker, though of its namespace, cannot trace it
    worker = os.fork()
    if worker == 0:
        code = 72
        try:
            os.close(status_fd)
            code = _worker(req, sock_fd, args, mode, t0)
        except BaseException as e:
            _refuse(sock_fd, f"the worker's isolation failed: {type(e).__name__}: {e}")
        finally:
            os._exit(code)
    os.close(sock_fd)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 0
        except InterruptedError:
            continue
        if pid == worker:
            try:
                os.write(status_fd, struct.pack("!i", status))
            except OSError:
                pass
            return 0


def _worker(req: dict, sock_fd: int, args, mode: str, t0: float) -> int:
    """The worker: every privilege dropped, then the worker's main loop (or, in exec mode, a
    fresh interpreter running it)."""
    from sandbox import isolation
    os.setsid()  # as bubblewrap's --new-session: no terminal to push input into
    os.chdir(WORKDIR)
    user = namespaces.drop_to_worker()
    namespaces.die_with_parent()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter has it
    os.environ["NIGHTSHIFT_WORKER"] = str(req.get("marker", ""))
    role, memory_gb = str(req.get("role", "candidate")), float(req.get("memory_gb") or 0)
    fraction = float(req.get("gpu_memory_fraction", 0.9))
    flags = ["--fd", str(sock_fd), "--parent", str(args.parent), "--device", args.device, "--role", role,
             "--memory-gb", str(memory_gb), "--gpu-memory-fraction", str(fraction)] + \
        [a for p in args.preload for a in ("--preload", p)] + ["--jailed"]
    if mode != "fork":
        os.set_inheritable(sock_fd, True)
        os.execv(sys.executable, [sys.executable, "-m", "sandbox.worker", *flags])
    from sandbox import worker
    sys.argv = [worker.__file__, *flags]  # as a worker started afresh sees its command line
    args.role, args.memory_gb, args.gpu_memory_fraction = role, memory_gb, fraction
    report = {"parent_death": "its fork server's jail (--die-with-parent); its own pid namespace",
              "user": user, "network": "empty namespace of its own"}
    mem = int(memory_gb * (1 << 30)) if memory_gb and args.device == "cpu" else None
    report["limits"] = isolation.limit_resources(mem)
    worker.run(args, report, socket.socket(fileno=sock_fd), {"fork": time.perf_counter() - t0}, preloaded=True)
    return 0


def probe() -> int:
    """Whether a worker can be forked here: the setup, init and worker steps, run once on a
    dummy; prints what the dummy saw and exits 0 if it is isolated as a worker must be."""
    import json
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            namespaces.enter_worker_namespaces(WORKDIR, 1 << 20, [])
            init = os.fork()
            if init == 0:
                namespaces.mount_own_proc()
                child = os.fork()
                if child == 0:
                    user = namespaces.drop_to_worker()
                    seen = {"user": user, "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
                            "caps": namespaces.capabilities(), "uid": os.getuid()}
                    os.write(w, json.dumps(seen).encode())
                    os._exit(0)
                os._exit(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
            os._exit(os.waitstatus_to_exitcode(os.waitpid(init, 0)[1]))
        except BaseException as e:
            os.write(w, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
            os._exit(1)
    os.close(w)
    out = b""
    while chunk := os.read(r, 65536):
        out += chunk
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    seen = json.loads(out or b"{}")
    if not seen.get("error") and (seen.get("pids") != [1, 2] or any(seen.get("caps", {"?": 1}).values())):
        seen["error"] = f"the forked dummy was not isolated: {seen}"
    print(json.dumps(seen), flush=True)
    return 0 if code == 0 and not seen.get("error") else 1


if __name__ == "__main__":
    main()
