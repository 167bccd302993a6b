"""Every way out of `agent tune`, repeated: does any end in an abort, a traceback or an orphan?

    python bench/exit_bench.py [--repeats 30] [--paths interrupted,resumed,finished] [--entry script|module]
                               [--out DIR]

A race at the interpreter's exit shows in one run of dozens, so each exit path runs `--repeats`
times, on the CPU, as a real `agent tune` process:

- finished: a tune of tests/models/pointwise_chain.py with the compiler planner and one candidate
  that ends on its own, integration and the report included: its winner is torch.compile of the
  region. The first is a fresh tune; the others resume it (its candidate cap is reached at once,
  so each goes straight to integrating the compile winner), which spares them the profile and
  the trial's compile (minutes on two loaded cores), not the end they all share. Exit 0.
- interrupted: a fresh tune of tests/models/tiny_rmsnorm.py, stopped in one phase (profiling,
  the search after its first trial, integration) by one way (Ctrl-C, SIGTERM, a hangup, Ctrl-C
  twice), taken in turn. Exit 130.
- resumed: `agent tune --resume` of one tiny RMSNorm run killed with -9 twice first, stopped
  mid-search the same ways in turn. Exit 130.

Every other run sits in a terminal (a pseudo-terminal: the live table, Ctrl-C typed as ^C, the
hangup by closing the terminal), the rest write to a file (Ctrl-C is SIGINT to the process group,
the hangup SIGHUP to the tuner). `--entry script` (the default) starts the tuner as pip's `agent`
console script does (the function pyproject.toml names, its return passed to sys.exit);
`--entry module` as `python -m agent`.

Per run: the exit status; `abort` when it died of SIGABRT or printed `terminate called`;
`traceback`; anything printed after the resume line; processes of the tuner left alive (its
process group, its workers); whether the store reads (`PRAGMA integrity_check`) and holds every
trial it held when the signal was sent. A table of the exit statuses per path comes last.
"""

from __future__ import annotations

import argparse
import os
import pty
import re
import select
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POINTWISE = ROOT / "tests" / "models" / "pointwise_chain.py"
TINY = ROOT / "tests" / "models" / "tiny_rmsnorm.py"
WAYS = ("Ctrl-C", "SIGTERM", "SIGHUP", "Ctrl-C twice")
PHASES = ("profile", "search", "integration")


def launcher(entry: str) -> list[str]:
    if entry == "module":
        return [sys.executable, "-m", "agent"]
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["agent"]
    module, _, func = target.partition(":")
    return [sys.executable, "-c", f"import sys; from {module} import {func}; sys.argv[0] = 'agent'; sys.exit({func}())"]


class Tuner:
    """One `agent tune` process, in a terminal of its own (`tty`) or writing to `log`."""

    def __init__(self, cmd: list[str], args: list, log: Path, tty: bool):
        argv = [*cmd, *map(str, args)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.tty, self.log, self.code = tty, log, None
        if tty:
            self.pid, self.master = pty.fork()  # the child leads a session whose terminal is the pty
            if self.pid == 0:
                os.chdir(log.parent)
                _defaults()
                os.execve(argv[0], argv, env)
            self.hangup = threading.Event()
            self.copier = threading.Thread(target=self._copy, daemon=True)
            self.copier.start()
        else:
            with open(log, "w") as f:
                self.proc = subprocess.Popen(argv, cwd=log.parent, env=env, stdin=subprocess.DEVNULL, stdout=f,
                                             stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_defaults)
            self.pid = self.proc.pid

    def _copy(self) -> None:
        """The terminal's output into the log; the terminal closes here (a read blocked on it elsewhere
        would keep it open)."""
        with open(self.log, "wb") as f:
            while not self.hangup.is_set():
                if not select.select([self.master], [], [], 0.1)[0]:
                    continue
                try:
                    data = os.read(self.master, 65536)
                except OSError:  # the tuner ended
                    break
                if not data:
                    break
                f.write(data)
                f.flush()
        os.close(self.master)

    def poll(self) -> int | None:
        if self.code is None:
            if self.tty:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.code = os.waitstatus_to_exitcode(status)
            else:
                self.code = self.proc.poll()
        return self.code

    def wait(self, timeout: float) -> int | str:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                os.killpg(self.pid, signal.SIGKILL)
                while self.poll() is None:
                    time.sleep(0.1)
                return f"hung ({self.code})"
            time.sleep(0.1)
        if self.tty:
            self.copier.join(timeout=5)
        return self.code

    def stop(self, way: str) -> None:
        if way == "Ctrl-C twice":  # an impatient user: the second one lands while the first is being handled
            self.stop("Ctrl-C")
            time.sleep(0.3)
            way = "Ctrl-C"
        if self.tty and way == "Ctrl-C":
            os.write(self.master, b"\x03")  # typed: the terminal sends SIGINT to its foreground group
        elif self.tty and way == "SIGHUP":
            self.hangup.set()  # the terminal window closes: the kernel hangs up its session
        elif way == "Ctrl-C":
            os.killpg(self.pid, signal.SIGINT)
        else:
            os.kill(self.pid, signal.SIGTERM if way == "SIGTERM" else signal.SIGHUP)


def _defaults() -> None:
    """Ctrl-C and hangups at their defaults, as in a shell's foreground job (a script started in
    the background with `&` has SIGINT ignored, and its children would inherit that)."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def trials_in(run: Path | None) -> int:
    if run is None or not (run / "trials.sqlite").is_file():
        return 0
    db = sqlite3.connect(f"file:{run / 'trials.sqlite'}?mode=ro", uri=True, timeout=10)
    try:
        return db.execute("SELECT COUNT(*) FROM trials").fetchone()[0]
    except sqlite3.Error:
        return 0
    finally:
        db.close()


def best_template(run: Path | None) -> str | None:
    """The template of the run's fastest passing trial (`torch_compile`: torch.compile of the region)."""
    if run is None or not (run / "trials.sqlite").is_file():
        return None
    db = sqlite3.connect(f"file:{run / 'trials.sqlite'}?mode=ro", uri=True, timeout=10)
    try:
        row = db.execute("SELECT template FROM trials WHERE status = 'ok' ORDER BY speedup DESC LIMIT 1").fetchone()
        return row[0] if row else None
    finally:
        db.close()


def store_ok(run: Path | None) -> bool:
    if run is None or not (run / "trials.sqlite").is_file():
        return True  # nothing was recorded (a profile stopped before its run folder was kept)
    db = sqlite3.connect(f"file:{run / 'trials.sqlite'}?mode=ro", uri=True, timeout=10)
    try:
        return db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        db.close()


def left_behind(pid: int) -> list[int]:
    """Processes of the tuner still running: its process group (a probe it started), and its workers
    (`--parent PID`). Zombies are not counted: where no init reaps them (a container), they stay."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            if Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            worker = b"--parent" in cmd and cmd[cmd.index(b"--parent") + 1] == str(pid).encode()
            if os.getpgid(int(entry)) == pid or worker:
                found.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _describe(pid: int) -> str:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        return f"state {state[0]} ppid {state[1]}: {cmd[:120]} ... {cmd[-200:]}"
    except (OSError, IndexError):
        return "(gone)"


def newest_run(runs: Path) -> Path | None:
    found = sorted(runs.glob("*/run.json"), key=lambda p: p.stat().st_mtime)
    return found[-1].parent if found else None


def wait_until(tuner: Tuner, ready, timeout: float = 600) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tuner.poll() is not None:
            return False
        if ready():
            return True
        time.sleep(0.05)
    return False


def finish(tuner: Tuner, run: Path | None, held: int, label: str, expect: int = 130, timeout: float = 900) -> dict:
    code = tuner.wait(timeout)
    deadline = time.monotonic() + 5  # a process of the tuner's still ending has its moment
    while (orphans := left_behind(tuner.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if orphans:
        with open(tuner.log, "a") as f:
            for pid in orphans:
                f.write(f"\nbench: left behind: {pid} {_describe(pid)}")
    for pid in orphans:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", tuner.log.read_text(errors="replace")).replace("\r", "")
    if tuner.tty:  # the terminal's own echo of a typed Ctrl-C, not the tuner's output
        text = text.replace("^C", "")
    resumed = "continue with: agent tune --resume"
    after = text.rsplit(resumed, 1)[1].partition("\n")[2] if resumed in text else ""
    run = run or newest_run(tuner.log.parent / "runs")
    # Where a run was kept its resume line comes last: on the terminal, or (the terminal gone) in its log.
    kept = run is not None and (run / "run.json").is_file()
    said = resumed in text or (kept and resumed in _read(run / "log.txt").rstrip().rpartition("\n")[2])
    return {"path": label + (" (terminal)" if tuner.tty else ""), "code": code, "expected": code == expect,
            "no_resume_line": kept and not said,
            "compile_winner": best_template(run) == "torch_compile",
            "abort": code == -signal.SIGABRT or "terminate called" in text, "traceback": "Traceback" in text,
            "after_resume_line": after.strip()[:200], "orphans": len(orphans),
            "store_ok": store_ok(run) and trials_in(run) >= held, "log": str(tuner.log)}


def finished(cmd: list[str], work: Path, i: int, base: Path | None) -> dict:
    args = ["--resume", base] if base else ["--model", POINTWISE, "--runs-dir", work / "runs", "--planner", "compiler",
                                            "--max-candidates", 1, "--devices", "cpu"]
    tuner = Tuner(cmd, ["tune", *args], work / "out.txt", tty=i % 2 == 1)
    return finish(tuner, base, trials_in(base), "finished" + (" (resumed)" if base else ""), expect=0)


def interrupted(cmd: list[str], work: Path, i: int) -> dict:
    way, phase = WAYS[i % 4], PHASES[(i // 4) % 3]
    runs = work / "runs"
    tuner = Tuner(cmd, ["tune", "--model", TINY, "--runs-dir", runs, "--max-candidates", 3, "--devices", "cpu"],
                  work / "out.txt", tty=(i // 12) % 2 == 1)
    if phase == "profile":
        ready = lambda: runs.is_dir() and any(runs.iterdir())  # noqa: E731
    elif phase == "search":
        ready = lambda: trials_in(newest_run(runs)) >= 1  # noqa: E731
    else:
        ready = lambda: (r := newest_run(runs)) is not None and "integrating" in _read(r / "log.txt")  # noqa: E731
    reached = wait_until(tuner, ready)
    run, held = newest_run(runs), trials_in(newest_run(runs))
    if reached:
        tuner.stop(way)
    return finish(tuner, run, held, f"interrupted: {way} in {phase}" + ("" if reached else " (ended first)"))


def resumed(cmd: list[str], work: Path, run: Path, i: int) -> dict:
    way = WAYS[i % 4]
    held = trials_in(run)
    tuner = Tuner(cmd, ["tune", "--resume", run, "--max-candidates", held + 1000], work / "out.txt",
                  tty=(i // 4) % 2 == 1)
    reached = wait_until(tuner, lambda: trials_in(run) > held)
    held = trials_in(run)
    if reached:
        tuner.stop(way)
    return finish(tuner, run, held, f"resumed: {way} in search" + ("" if reached else " (ended first)"))


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def killed_twice(cmd: list[str], work: Path) -> Path:
    """A tiny RMSNorm run killed with -9 (tuner and workers) twice mid-search, as the resumed runs start from."""
    runs = work / "runs"
    work.mkdir(parents=True, exist_ok=True)
    run = None
    for n in (1, 2):
        args = ["--model", TINY, "--runs-dir", runs, "--devices", "cpu"] if run is None else ["--resume", run]
        tuner = Tuner(cmd, ["tune", *args, "--max-candidates", 1000], work / f"killed-{n}.txt", tty=False)
        wait_until(tuner, lambda: trials_in(newest_run(runs)) >= 2 * n)
        run = newest_run(runs)
        for pid in [tuner.pid, *left_behind(tuner.pid)]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        tuner.wait(60)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--paths", default="interrupted,resumed,finished")
    ap.add_argument("--entry", choices=("script", "module"), default="script")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="exit-bench-"))
    cmd = launcher(args.entry)
    rows: list[dict] = []
    print(f"{time.strftime('%Y-%m-%d %H:%M')}  entry {args.entry}: {' '.join(cmd[1:])}; out: {out}", flush=True)
    resumed_run = finished_run = None
    for path in args.paths.split(","):
        for i in range(args.repeats):
            work = out / path / f"{i:03d}"
            work.mkdir(parents=True, exist_ok=True)
            if path == "finished":
                row = finished(cmd, work, i, finished_run)
                finished_run = finished_run or newest_run(work / "runs")
            elif path == "interrupted":
                row = interrupted(cmd, work, i)
            else:
                resumed_run = resumed_run or killed_twice(cmd, out / path / "base")
                row = resumed(cmd, work, resumed_run, i)
            rows.append(row)
            bad = [k for k in ("abort", "traceback") if row[k]] + (["orphans"] if row["orphans"] else []) \
                + ([] if row["expected"] or "ended first" in row["path"] else ["unexpected status"]) \
                + (["no resume line"] if row["no_resume_line"] else []) \
                + ([] if row["store_ok"] else ["store"]) + (["after resume line"] if row["after_resume_line"] else [])
            print(f"{row['path']:<46} exit {row['code']!s:<5} {' '.join(bad) or 'clean'}"
                  + (" (winner: torch.compile of the region)" if row["compile_winner"] else "")
                  + (f"  ({row['log']})" if bad else ""), flush=True)
    print(f"\n{'exit path':<12} {'runs':>4}  {'exit statuses':<22} abort  traceback  orphans  store lost  "
          "no resume line  printed after it")
    for label in dict.fromkeys(re.sub(r"[: ].*", "", r["path"]) for r in rows):
        group = [r for r in rows if r["path"].startswith(label)]
        codes = ", ".join(f"{c}×{n}" for c, n in sorted(Counter(str(r["code"]) for r in group).items()))
        print(f"{label:<12} {len(group):>4}  {codes:<22} {sum(r['abort'] for r in group):>5}  "
              f"{sum(r['traceback'] for r in group):>9}  {sum(bool(r['orphans']) for r in group):>7}  "
              f"{sum(not r['store_ok'] for r in group):>10}  {sum(r['no_resume_line'] for r in group):>14}  "
              f"{sum(bool(r['after_resume_line']) for r in group):>15}"
              f"   ({sum(r['path'].endswith('(terminal)') for r in group)} in a terminal"
              + (f", {sum(r['compile_winner'] for r in group)} with a torch.compile winner)" if label == "finished"
                 else ")"))


if __name__ == "__main__":
    main()
