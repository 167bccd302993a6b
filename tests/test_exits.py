"""Every way out of `agent tune` is clean: a real tuner process on a tiny model gets the real signal
in each phase of a night (profiling, freezing, the search, integration, the report), from a
terminal's Ctrl-C (SIGINT to its process group), kill (SIGTERM) or a hangup (SIGHUP, or the
terminal closing under it), and ends with exit 130, nothing printed after its last line, no
process of its own left, and every trial it had recorded still in a store that reads."""

import os
import pty
import re
import select
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PHASED = '''"""The tiny RMSNorm model; its forward, run whole by a phase of agent tune, touches a file named
after the phase in $PHASE_MARKS the first time and stays there three seconds, for a signal to land."""
import os, sys, time
import torch
from torch import nn

MARKS = os.environ.get("PHASE_MARKS", "")
PHASES = {"profile_model": "profile", "freeze": "freeze", "freeze_model": "freeze"}


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim) + 0.5)
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = RMSNorm(dim)

    def forward(self, x):
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_name not in PHASES:
            frame = frame.f_back
        mark = os.path.join(MARKS, PHASES[frame.f_code.co_name]) if MARKS and frame is not None else ""
        if mark and not os.path.exists(mark):
            open(mark, "w").close()
            time.sleep(3)
        return self.norm(x)


def get_init_inputs():
    return [64]


def get_inputs():
    return [torch.randn(8, 64)]
'''
# The report phase: agent.report.write, as the session calls it, marks it and stays three seconds first.
SLOW_REPORT = """import os, runpy, sys, time
from agent import report
write = report.write
def marked(run):
    open(os.path.join(os.environ["PHASE_MARKS"], "report"), "w").close()
    time.sleep(3)
    return write(run)
report.write = marked
sys.argv = ["agent", *sys.argv[1:]]
runpy.run_module("agent", run_name="__main__")
"""
WAYS = {"Ctrl-C": signal.SIGINT, "SIGTERM": signal.SIGTERM, "SIGHUP": signal.SIGHUP}


def env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def trials_in(run: Path) -> int:
    if not (run / "trials.sqlite").is_file():
        return 0
    db = sqlite3.connect(f"file:{run / 'trials.sqlite'}?mode=ro", uri=True, timeout=10)
    try:
        return db.execute("SELECT COUNT(*) FROM trials").fetchone()[0]
    except sqlite3.Error:
        return 0
    finally:
        db.close()


def runs_in(runs: Path) -> list[Path]:
    return [p.parent for p in runs.glob("*/run.json")]


def left_behind(pid: int) -> list[str]:
    """Processes of the tuner still running: its process group (a probe it started), and its sandbox
    workers (`--parent PID`). A zombie is not running: where no init reaps (a container), one stays."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            zombie = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
            worker = b"--parent" in cmd and cmd[cmd.index(b"--parent") + 1] == b"%d" % pid
            mine = os.getpgid(int(entry)) == pid or worker
        except (OSError, IndexError):
            continue
        if mine and not zombie:
            found.append(b" ".join(cmd).decode(errors="replace")[:200])
    return found


def assert_nothing_left(code: int, pid: int, text: str) -> None:
    """Exit 130, no abort or traceback, and no process of the tuner's alive."""
    assert code == 130, (code, text[-3000:])
    assert "Traceback" not in text and "terminate called" not in text, text[-3000:]
    deadline = time.monotonic() + 5
    while (left := left_behind(pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, left


def assert_run_whole(run: Path, held: int) -> None:
    """Every trial recorded before the signal still there, a store that reads, its last event the
    stop, the run's lock free for the next tuner."""
    db = sqlite3.connect(run / "trials.sqlite")
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert db.execute("SELECT COUNT(*) FROM trials").fetchone()[0] >= held
        assert db.execute("SELECT kind FROM events ORDER BY id DESC LIMIT 1").fetchone()[0] == "stop"
    finally:
        db.close()
    assert (run / "tune.lock").read_text() == ""


def last_line(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).replace("\r", "").rstrip().splitlines()[-1]


def defaults() -> None:
    """Ctrl-C and hangups at their defaults, as in a terminal's foreground job."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def reached(proc: subprocess.Popen, ready, out: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, "the tuner ended first:\n" + out.read_text()[-3000:]
        assert time.monotonic() < deadline, "never got there:\n" + out.read_text()[-3000:]
        time.sleep(0.05)


@pytest.mark.parametrize("phase,way", [("profile", "Ctrl-C twice"), ("freeze", "SIGHUP"), ("search", "Ctrl-C"),
                                       ("integration", "Ctrl-C twice"), ("report", "SIGHUP")])
def test_a_signal_in_each_phase_ends_the_tune_cleanly(tmp_path, phase, way):
    model, marks, runs, out = tmp_path / "phased.py", tmp_path / "marks", tmp_path / "runs", tmp_path / "out.txt"
    model.write_text(PHASED)
    marks.mkdir()
    entry = ["-c", SLOW_REPORT] if phase == "report" else ["-m", "agent"]
    lanes = "cpu@a,cpu@b" if phase == "search" else "cpu"  # two lanes, each with its trial cut short
    args = ["tune", "--model", model, "--runs-dir", runs, "--max-candidates", 1, "--devices", lanes]
    with open(out, "w") as f:  # a terminal's foreground job: its own process group, hangups at their default
        proc = subprocess.Popen([sys.executable, *entry, *map(str, args + ([] if phase == "integration" else
                                                                          ["--no-integrate"]))],
                                cwd=ROOT, env=env(PHASE_MARKS=str(marks)), stdin=subprocess.DEVNULL, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=defaults)
    try:
        if phase == "search":
            reached(proc, lambda: any(trials_in(r) for r in runs_in(runs)), out)
        elif phase == "integration":
            reached(proc, lambda: any((r / "log.txt").is_file() and "integrating" in (r / "log.txt").read_text()
                                         for r in runs_in(runs)), out)
        else:
            reached(proc, (marks / phase).exists, out)
        held = sum(trials_in(r) for r in runs_in(runs))
        for press in range(2 if way == "Ctrl-C twice" else 1):  # the second while the first is handled
            time.sleep(0.3 * press)
            os.killpg(proc.pid, WAYS[way.removesuffix(" twice")])  # to its process group, as a terminal sends them
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.read_text()
    assert_nothing_left(code, proc.pid, text)
    if phase in ("profile", "freeze"):  # nothing to resume: the half-made run folder is gone
        said = way.removesuffix(" twice")
        assert last_line(text) == f"error: interrupted ({said}); nothing half-made was kept", text[-2000:]
        assert not any(runs.iterdir())
        return
    (run,) = runs_in(runs)
    assert last_line(text) == f"continue with: agent tune --resume {run}", text[-2000:]
    assert {"search": f"stopped: interrupted ({way})", "integration": "integration interrupted",
            "report": "the report was interrupted"}[phase] in text, text[-2000:]
    assert_run_whole(run, held)


def test_a_closed_terminal_and_a_second_ctrl_c_end_the_tune_cleanly(tmp_path):
    """A tuner in a terminal that closes mid-search: a hung-up terminal answers no isatty, so the
    tuner kept writing to it and ended in an Input/output error (exit 1 or 2) instead of 130.
    Then, resumed there, Ctrl-C typed twice: the second stopped the search with an Outcome that
    had no `generations`, a traceback and exit 1."""
    runs, out = tmp_path / "runs", tmp_path / "out.txt"
    profiled = subprocess.run([sys.executable, "-m", "agent", "profile", "--model", ROOT / "tests" / "models" /
                               "tiny_rmsnorm.py", "--runs-dir", runs, "--json"], cwd=ROOT, env=env(),
                              capture_output=True, text=True, timeout=300)
    assert profiled.returncode == 0, profiled.stderr[-2000:]
    (run,) = runs_in(runs)
    for attempt, keys in ((0, None), (1, b"\x03\x03")):
        pid, terminal = pty.fork()  # the tuner leads a session whose terminal is this pty
        if pid == 0:
            defaults()
            os.execve(sys.executable, [sys.executable, "-m", "agent", "tune", "--resume", str(run), "--devices",
                                       "cpu", "--max-candidates", "50", "--no-integrate"], env(COLUMNS="120"))
        shown, held = b"", trials_in(run)
        deadline = time.monotonic() + 240
        try:
            while trials_in(run) <= held and time.monotonic() < deadline:
                if select.select([terminal], [], [], 0.1)[0]:
                    shown += os.read(terminal, 65536)
            held = trials_in(run)
            if keys is None:
                os.close(terminal)  # the window closes: the kernel hangs up the tuner's session
            else:
                os.write(terminal, keys[:1])
                time.sleep(0.3)
                os.write(terminal, keys[1:])
                while select.select([terminal], [], [], 60)[0]:
                    try:
                        chunk = os.read(terminal, 65536)
                    except OSError:  # the tuner ended, and its side of the terminal with it
                        break
                    if not chunk:
                        break
                    shown += chunk
            _, status = os.waitpid(pid, 0)
        finally:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        text = shown.decode(errors="replace")
        out.write_text(text)
        assert_nothing_left(os.waitstatus_to_exitcode(status), pid, text)
        if keys is None:  # what it said after the hangup went to the run's log only
            assert " stopped: interrupted (SIGHUP). " in last_line((run / "log.txt").read_text())
        else:
            assert last_line(text) == f"continue with: agent tune --resume {run}", text[-2000:]
            assert "stopped: interrupted (Ctrl-C)" in text
        assert_run_whole(run, held)


SLOW = """import time, torch

def forward(module, x):
    time.sleep(0.5)  # a trial that is still running when the search is left
    xf = x.float()
    return module.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.eps)).to(x.dtype)
"""


def test_a_search_left_mid_trial_ends_its_lanes_when_the_executor_closes(tmp_path):
    """A second Ctrl-C leaves the search loop, and with it the executor's trials, while lanes are
    mid-trial; a lane still inside torch when the interpreter exits aborts the process (SIGABRT),
    and only the exit's last resort kept that from happening. Closing the executor ends them."""
    from agent.search.budget import Budget
    from agent.executors.local import LocalExecutor, parse_devices
    from agent.search.feed import Feed
    from sandbox.runner import Limits
    from tools.problem import StopRule
    from tools.trial import Candidate
    profiled = subprocess.run([sys.executable, "-m", "agent", "profile", "--model", ROOT / "tests" / "models" /
                               "tiny_rmsnorm.py", "--runs-dir", tmp_path, "--json"], cwd=ROOT, env=env(),
                              capture_output=True, text=True, timeout=300)
    (run,) = runs_in(tmp_path)
    executor = LocalExecutor(parse_devices("cpu")[0], [run / "problems" / "RMSNorm"], Limits(budget_ms=50))
    feed = Feed(executor.generations)
    path = tmp_path / "slow.py"
    path.write_text(SLOW)
    feed.put([(Candidate(region="RMSNorm", source=SLOW.replace("0.5", f"0.5{i}"), planner="test"), "cpu", str(path))
              for i in range(5)])
    trials = executor.run(feed, Budget(StopRule(max_candidates=10)))
    try:
        assert next(t for t in trials if t is not None).status.value == "ok", profiled.stderr[-2000:]
        while not executor.in_flight():  # the next trial has begun
            next(trials)
        trials.close()  # as the interrupt out of the search loop closes it
    finally:
        executor.close()
    assert not [t for t in threading.enumerate() if t.name.endswith("(work)") and t.is_alive()]
