"""Workers forked from a fork server (sandbox/forkserver.py) keep every property the jail gives a
worker started afresh: each its own pid, mount, IPC, network and UTS namespaces, its own folder,
/dev/shm and /proc, nothing writable it shares with a sibling, no capability, `nobody` as root,
no_new_privs, non-dumpable; killed whole, its death seen; no server outlives its use or the tuner.
And the exec path stays: NIGHTSHIFT_FORK_WORKERS=0, or a machine where a fork cannot be isolated."""

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from sandbox import jail, procs, spawn, zygotes
from sandbox.client import Worker, WorkerConfig
from sandbox.runner import Limits, TrialRunner
from tools.trial import Candidate, Status

HERE = Path(__file__).parent
HOSTILE = HERE / "candidates" / "adversarial"
FORKS = pytest.mark.skipif(bool(jail.forking()), reason=f"workers are not forked here: {jail.forking()}")
OWN = "def forward(module, *args, **kwargs):\n    return type(module).forward(module, *args, **kwargs)\n"
LIMITS = Limits(compile_s=60, run_s=60, time_s=60, budget_ms=50, max_reps=20)


@pytest.fixture
def two_runners(frozen_run):
    """Two candidate runners of one configuration, so one fork server, beside its reference worker."""
    cfg = WorkerConfig(device="cpu", memory_gb=6)
    a = TrialRunner("cpu", LIMITS, cfg)
    b = TrialRunner("cpu", LIMITS, cfg, reference=a.reference)
    for r in (a, b):
        r.add_problem(frozen_run / "LlamaRMSNorm")
    yield a, b
    b.worker.close()
    a.close()


def _status(pid: int) -> dict[str, list[str]]:
    return {k: v.split() for k, _, v in (line.partition(":") for line in Path(f"/proc/{pid}/status").read_text()
                                         .splitlines())}


def _the_worker(w: Worker) -> int:
    """The worker's process (pid 2 of its namespace) among the jail's processes."""
    return next(p for p in w.members() if _status(p)["NSpid"][-1] == "2")


@FORKS
def test_forked_workers_are_isolated_as_the_jail_says(two_runners):
    a, b = two_runners
    for r in (a, b):
        assert r.run(Candidate(region="LlamaRMSNorm", source=OWN), do_time=False).status is Status.ok
    workers = [a.worker, b.worker, a.reference.worker]
    assert all(isinstance(w.proc, zygotes.ForkedProc) for w in workers)
    assert len({w.proc.zygote for w in workers}) == 1  # siblings: one server forked all three
    server = next(iter(zygotes._ZYGOTES.values())).proc.pid
    pids = [_the_worker(w) for w in workers]
    for pid in pids:
        st = _status(pid)
        if os.geteuid() == 0:
            assert st["Uid"] == ["65534"] * 4 and st["Gid"] == ["65534"] * 4, st["Uid"]
        assert all(int(st[c][0], 16) == 0 for c in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")), st
        assert st["NoNewPrivs"] == ["1"] and st["NSpid"][-1] == "2"
        assert os.stat(f"/proc/{pid}/environ").st_uid == 0 != int(st["Uid"][0])  # non-dumpable: root's files
        # What the worker sees as /proc: its own namespace only (its init and itself).
        assert sorted(int(p) for p in os.listdir(f"/proc/{pid}/root/proc") if p.isdigit()) == [1, 2]
        mounts = [line.split() for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()]
        writable = {m[4] for m in mounts if "rw" in m[5].split(",") and os.path.isdir(f"/proc/{pid}/root{m[4]}")}
        assert writable <= {jail.WORKDIR, "/dev/shm", "/dev/pts", "/proc"}, writable  # all its own
        sizes = {m[4]: " ".join(m[m.index("-") + 1:]) for m in mounts}
        limits = Path(f"/proc/{pid}/limits").read_text()
        assert re.search(rf"Max address space\s+{6 << 30}\s", limits) and re.search(r"Max core file size\s+0\s", limits)
        pages_k = -(-jail.folder_bytes(6) // 4096) * 4  # the size asked for, in whole pages
        assert f"size={pages_k}k" in sizes[jail.WORKDIR] and f"size={pages_k}k" in sizes["/dev/shm"]
    first, _ = procs.pid_namespace(server)
    # The server's socket to the tuner (what asks it to fork) reaches none of a worker's processes.
    zygote = procs.children(first)[0]
    theirs = {os.readlink(f"/proc/{zygote}/fd/{fd}") for fd in os.listdir(f"/proc/{zygote}/fd")}
    for w in workers:
        for pid in w.members() | {w.proc.pid}:
            held = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
            assert not {h for h in held & theirs if h.startswith("socket:")}, (pid, held & theirs)
    for kind in ("pid", "mnt", "net", "ipc", "uts"):
        seen = {os.readlink(f"/proc/{pid}/ns/{kind}") for pid in pids}
        assert len(seen) == 3 and os.readlink(f"/proc/{first}/ns/{kind}") not in seen, kind


POISON_CHECK = '''
import ctypes, os, platform, socket
PLACES = ["..", "/tmp", "/dev/shm", "/var/tmp", "/run", "/dev", os.path.expanduser("~"),
          os.path.expanduser("~/.triton/cache"), os.environ.get("TORCHINDUCTOR_CACHE_DIR", "/tmp/x"),
          os.environ.get("TRITON_CACHE_DIR", "/tmp/triton")]
found = [os.path.join(p, n) for p in PLACES for n in ("poison_{marker}.py", "sitecustomize.py", "__triton_launcher.so")
         if os.path.exists(os.path.join(p, n))]
if ctypes.CDLL(None).shmget(0x5EED, 0, 0) >= 0:
    found.append("System V segment 0x5EED")
try:
    socket.socket(socket.AF_UNIX).connect("\\0poison_{marker}")
    found.append("abstract socket")
except OSError:
    pass
if ctypes.CDLL("librt.so.1").mq_open(b"/poison_{marker}", 0) >= 0:
    found.append("message queue")
keyctl = {"x86_64": 250, "aarch64": 219}.get(platform.machine())
if keyctl and ctypes.CDLL(None).syscall(keyctl, 10, ctypes.c_long(-4), b"user", b"poison_{marker}", 0) >= 0:
    found.append("a key in its user's keyring")  # KEYCTL_SEARCH of KEY_SPEC_USER_KEYRING


def forward(module, x):
    if found or os.environ.get("POISONED"):
        raise RuntimeError(f"a sibling's poison is visible: {found}")
    return type(module).forward(module, x)
'''


@FORKS
def test_a_sibling_sees_nothing_another_worker_wrote(two_runners):
    """poisons_shared_places writes into every place a sibling might read (and keeps its worker
    alive: its trial is ok); a sibling forked from the same server then looks for all of it."""
    a, b = two_runners
    marker = f"poison-{os.getpid()}"
    writer = (HOSTILE / "poisons_shared_places.py").read_text().replace("{marker}", marker)
    assert a.run(Candidate(region="LlamaRMSNorm", source=writer), do_time=False).status is Status.ok
    assert a.worker.alive and b.run(Candidate(region="LlamaRMSNorm", source=OWN), do_time=False).status is Status.ok
    assert a.worker.proc.zygote is b.worker.proc.zygote
    # The writer did write, in its own folder: the check below is not vacuous.
    assert (Path(f"/proc/{_the_worker(a.worker)}/root") / jail.WORKDIR.lstrip("/") / f"poison_{marker}.py").exists()
    check = b.run(Candidate(region="LlamaRMSNorm", source=POISON_CHECK.replace("{marker}", marker)), do_time=False)
    assert check.status is Status.ok, check.error_text[-800:]
    assert a.worker.alive


@FORKS
def test_a_worker_signalling_everything_harms_no_sibling_nor_the_server(two_runners):
    a, b = two_runners
    assert b.run(Candidate(region="LlamaRMSNorm", source=OWN), do_time=False).status is Status.ok
    sibling, server = b.worker.members(), b.worker.proc.zygote
    hostile = (HOSTILE / "signals_everything.py").read_text()
    trial = a.run(Candidate(region="LlamaRMSNorm", source=hostile), do_time=False)
    assert trial.status is Status.ok, trial.error_text[-800:]
    assert b.worker.members() == sibling and all(_status(p)["State"][0] != "T" for p in sibling)
    assert server.proc.poll() is None and not server.ended
    assert b.run(Candidate(region="LlamaRMSNorm", source=OWN), do_time=False).status is Status.ok


DIES_HARD = '''
import os, signal, time
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
for _ in range(3):
    if os.fork() == 0:
        os.setsid()
        time.sleep(300)
        os._exit(0)


def forward(module, x):
    os.kill(os.getpid(), signal.SIGSEGV)
'''


@FORKS
def test_a_forked_workers_death_is_seen_and_a_kill_ends_all_it_started(two_runners, monkeypatch):
    a, _ = two_runners
    trial = a.run(Candidate(region="LlamaRMSNorm", source=DIES_HARD), do_time=False)
    assert trial.status is Status.crash and "killed by SIGSEGV" in trial.error_text, trial.error_text[-800:]
    # Children that ignore every signal but SIGKILL, each in a session of its own: the kill
    # that replaces the worker ends them all before it returns.
    seen: list[set[int]] = []
    real_kill = a.worker.kill

    def spy() -> None:
        seen.append(a.worker.members())
        real_kill()
    monkeypatch.setattr(a.worker, "kill", spy)
    ignoring = DIES_HARD.replace("os.kill(os.getpid(), signal.SIGSEGV)", "return type(module).forward(module, x)")
    trial = a.run(Candidate(region="LlamaRMSNorm", source=ignoring), do_time=False)
    assert trial.status is Status.ok and "the candidate left processes running: its worker was replaced" in trial.flags
    jail_pids = max(seen, key=len)
    assert len(jail_pids) >= 5, jail_pids  # init, worker, three children in sessions of their own
    assert all(_gone(p) for p in jail_pids)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


@FORKS
def test_a_fork_server_ends_with_its_last_handle_and_with_the_tuner(tmp_path):
    cfg = WorkerConfig(device="cpu", hide=[str(tmp_path / "run")])
    one, two = Worker(cfg), Worker(cfg)
    assert one.start().ok and two.start().ok
    server = one.proc.zygote
    assert two.proc.zygote is server
    one.close()
    assert server.proc.poll() is None  # the other handle still uses it
    two.close()
    assert server.proc.poll() is not None
    # A tuner killed with SIGKILL leaves no server and no worker behind.
    code = ("import sys, time; sys.path.insert(0, %r)\nfrom sandbox.client import Worker, WorkerConfig\n"
            "w = Worker(WorkerConfig(device='cpu')); assert w.start().ok; print('up', flush=True); time.sleep(120)"
            % str(HERE.parent))
    tuner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert tuner.stdout.readline().strip() == "up"
        mine = _processes_naming(tuner.pid)
        assert len(mine) >= 3  # the server, and the worker's init and worker at least
        tuner.send_signal(signal.SIGKILL)
        tuner.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _processes_naming(tuner.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _processes_naming(tuner.pid) == []
        # Its server's folder outlived it (no exit ran); the next server started sweeps it.
        left = list(Path(tempfile.gettempdir()).glob(f"{zygotes.FOLDER_PREFIX}{tuner.pid}-*"))
        assert left
        assert zygotes.sweep() >= 1 and not any(p.exists() for p in left)
    finally:
        if tuner.poll() is None:
            tuner.kill()
    # A tuner that exits leaves no folder: its exit stops the servers and removes theirs.
    done = subprocess.Popen([sys.executable, "-c", code.replace("time.sleep(120)", "pass")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = done.communicate(timeout=120)
    assert done.returncode == 0 and out.strip() == "up", err[-2000:]
    assert not list(Path(tempfile.gettempdir()).glob(f"{zygotes.FOLDER_PREFIX}{done.pid}-*"))


def _processes_naming(parent: int) -> list[int]:
    mark = f"--parent\0{parent}\0".encode()
    out = []
    for p in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            if mark in Path(f"/proc/{p}/cmdline").read_bytes():
                out.append(int(p))
        except OSError:
            pass
    return [p for p in out if not _gone(p)]


def test_the_exec_path_stays_where_forking_is_off_or_cannot_isolate(monkeypatch):
    monkeypatch.setenv(jail.FORK_ENV, "0")
    assert jail.forking() == f"turned off ({jail.FORK_ENV}=0)"
    w = Worker(WorkerConfig(device="cpu"))
    try:
        assert w.start().ok and isinstance(w.proc, subprocess.Popen) and "start" not in w.hello["isolation"]
    finally:
        w.close()
    monkeypatch.setenv(jail.FORK_ENV, "1")
    if jail.describe().kind != "bubblewrap":
        return
    monkeypatch.setattr(jail, "_fork_probe", lambda exe, euid: ("a forked worker could not be isolated here: x", ""))
    assert "started afresh (fork server not used: a forked worker could not be isolated" in jail.describe().isolated[-1]
    w = Worker(WorkerConfig(device="cpu"))
    try:
        assert w.start().ok and isinstance(w.proc, subprocess.Popen)
    finally:
        w.close()


@FORKS
def test_forked_then_execd_workers_keep_the_namespaces(frozen_run, monkeypatch):
    """NIGHTSHIFT_FORK_WORKERS=exec (what a server does by itself where a preloaded library
    initialised CUDA): forked into namespaces of their own, then a fresh interpreter."""
    monkeypatch.setenv(jail.FORK_ENV, "exec")
    r = TrialRunner("cpu", LIMITS, WorkerConfig(device="cpu", memory_gb=6))
    try:
        r.add_problem(frozen_run / "LlamaRMSNorm")
        hostile = (HOSTILE / "signals_everything.py").read_text()
        assert r.run(Candidate(region="LlamaRMSNorm", source=hostile), do_time=False).status is Status.ok
        assert "fork then exec" in r.worker.hello["isolation"]["start"]
        pid = _the_worker(r.worker)
        assert "sandbox.worker" in Path(f"/proc/{pid}/cmdline").read_text()
        assert sorted(int(p) for p in os.listdir(f"/proc/{pid}/root/proc") if p.isdigit()) == [1, 2]
        assert int(_status(pid)["CapEff"][0], 16) == 0 and _status(pid)["NoNewPrivs"] == ["1"]
    finally:
        r.close()


@pytest.mark.skipif(jail.describe().kind != "bubblewrap", reason="the hostile candidates run only jailed")
@pytest.mark.parametrize("name", ["signals_everything", "poisons_shared_places", "ptraces_anything",
                                  "regains_privileges", "signals_parent", "forges_reply"])
def test_hostile_candidates_get_their_status_on_the_exec_path_too(name, frozen_run, monkeypatch):
    """The adversarial suite runs on the default path (forked); these keep the exec path honest."""
    monkeypatch.setenv(jail.FORK_ENV, "0")
    r = TrialRunner("cpu", LIMITS, WorkerConfig(device="cpu", memory_gb=6))
    try:
        r.add_problem(frozen_run / "LlamaRMSNorm")
        path = HOSTILE / f"{name}.py"
        trial = r.run(Candidate(region="LlamaRMSNorm", source=path.read_text().replace("{marker}", "m")),
                      do_time=False)
        assert isinstance(r.worker.proc, subprocess.Popen) or r.worker.proc is None
        declared = set(re.search(r"EXPECT: ([\w|]+)", path.read_text()).group(1).split("|"))
        assert trial.status.value in declared, (trial.status, trial.error_text[-800:])
    finally:
        r.close()


@FORKS
def test_a_forked_worker_that_refuses_to_start_turns_forking_off_and_its_start_execs(monkeypatch):
    """A forked worker whose hello refuses (here: a CUDA worker on a machine without one; on a
    GPU machine, a device its namespaces cannot open) is not the end of the run: forking is off
    for the rest of the process, with the reason where `agent doctor` reads it, and the same
    start is tried once afresh."""
    monkeypatch.setattr(jail, "FORK_FAILED", [])
    started: list[str] = []
    real = spawn._spawn
    monkeypatch.setattr(spawn, "_spawn", lambda argv, **kw: started.append(" ".join(argv)) or real(argv, **kw))
    worker = Worker(WorkerConfig(device="cuda"))
    try:
        got = worker.start()
    finally:
        worker.close()
    assert not got.ok and "CUDA is not available in the worker" in got.error, got.error[-500:]
    assert jail.forking().startswith("a forked worker refused to start here: CUDA is not available")
    kinds = ["server" if "sandbox.forkserver" in a else "worker" if "sandbox.worker" in a else a for a in started]
    assert kinds == ["server", "worker"], started  # forked first, then the one exec'd retry
