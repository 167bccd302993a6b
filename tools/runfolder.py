"""A run is a self-describing folder: what was profiled, frozen, tried and found.

    runs/<run-id>/run.json          model, hashes, devices, versions, options (the tune settings)
    runs/<run-id>/hotspots.json     the profile;  trace.json  its Chrome trace
    runs/<run-id>/problems/<name>/  frozen problems (see tools.problem)
    runs/<run-id>/candidates/       every candidate's source, by hash
    runs/<run-id>/trials.sqlite     every finished trial (see tools.store)
    runs/<run-id>/log.txt           the tuner's progress lines, appended by every session
    runs/<run-id>/tune.lock         held by the one tuner working on the run (see RunLock)
    runs/<run-id>/inbox/            candidates dropped in by an outside agent (files planner)
    runs/<run-id>/compile_cache/    each compile baseline's Inductor and Triton caches (agent.review.compile_caches)

Everything that can go wrong with the folder itself (a runs directory that is a file or not
writable, a garbage run.json, a damaged or vanished store) is a `ProblemError` whose one line
names the file and says what to do.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from tools import strict_json
from tools.problem import FULL_BELOW, Problem, ProblemError, free_bytes
from tools.store import Store, StoreError

STORE_FILE = "trials.sqlite"
LOCK_FILE = "tune.lock"
LOG_FILE = "log.txt"
WORKER_DIR_PREFIX = "nightshift-worker-"
"""sandbox/client.py makes each worker's private folder under the system temp dir with it."""


class RunInfo(BaseModel):
    run_id: str
    model_file: str
    model_hash: str
    device: str
    created_at: float = Field(default_factory=time.time)
    versions: dict[str, str] = Field(default_factory=dict)
    options: dict[str, Any] = Field(default_factory=dict)
    """What the run was started with (budget, planner, devices, ...), for --resume."""
    skipped: dict[str, str] = Field(default_factory=dict)
    """Regions that were not frozen, and why."""


class RunBusy(ProblemError):
    """Another live tuner holds the run."""


def check_runs_dir(runs_dir: Path) -> None:
    """Fail now, before any work, if run folders cannot be made under `runs_dir`."""
    runs_dir = Path(runs_dir)
    if runs_dir.exists() and not runs_dir.is_dir():
        raise ProblemError(f"--runs-dir {runs_dir}: is a file, not a directory")
    existing = runs_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ProblemError(f"--runs-dir {runs_dir}: {existing} is a file, not a directory")
    try:  # asking the file system itself: permissions, read-only mounts, root or not
        os.rmdir(tempfile.mkdtemp(prefix=".nightshift-probe-", dir=existing))
    except OSError as e:
        raise ProblemError(f"--runs-dir {runs_dir}: cannot create folders in {existing} ({e.strerror}); "
                           "choose another --runs-dir") from None


class RunFolder:
    def __init__(self, path: Path):
        self.path = Path(path)

    @classmethod
    def create(cls, runs_dir: Path, model_file: Path) -> "RunFolder":
        check_runs_dir(runs_dir)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = Path(runs_dir) / f"{Path(model_file).stem}-{stamp}"
        path, i = base, 2
        while path.exists():
            path, i = Path(f"{base}-{i}"), i + 1
        try:
            path.mkdir(parents=True)
        except OSError as e:
            raise ProblemError(f"--runs-dir {runs_dir}: cannot create {path} ({e.strerror})") from None
        return cls(path)

    @classmethod
    def open(cls, path: Path) -> "RunFolder":
        path = Path(path)
        if not (path / "run.json").is_file():
            raise ProblemError(f"{path}: not a run folder (no run.json)")
        folder = cls(path)
        folder.info()  # a garbage run.json is named now, not in a traceback later
        return folder

    @property
    def run_id(self) -> str:
        return self.path.name

    @property
    def problems_dir(self) -> Path:
        return self.path / "problems"

    @property
    def candidates_dir(self) -> Path:
        return self.path / "candidates"

    @property
    def inbox(self) -> Path:
        return self.path / "inbox"

    @property
    def store_path(self) -> Path:
        return self.path / STORE_FILE

    @property
    def log_path(self) -> Path:
        return self.path / LOG_FILE

    def info(self) -> RunInfo:
        path = self.path / "run.json"
        try:
            return RunInfo.model_validate_json(path.read_text())
        except (ValueError, OSError) as e:
            first = str(e).strip().splitlines()
            why = " ".join(first[:3]) if first else type(e).__name__
            raise ProblemError(f"{path} is not a valid run description ({why}); restore it, or profile the "
                               "model again for a new run") from None

    def write_info(self, info: RunInfo) -> None:
        tmp = self.path / "run.json.tmp"
        try:
            tmp.write_text(strict_json.dumps(info, indent=2))
        except OSError as e:  # raised as the file closes (a full disk), where it names no file
            tmp.unlink(missing_ok=True)
            raise OSError(e.errno, e.strerror, str(self.path / "run.json")) from None
        tmp.replace(self.path / "run.json")

    def update_options(self, **options: Any) -> RunInfo:
        info = self.info()
        info.options.update(options)
        self.write_info(info)
        return info

    def problems(self) -> list[Problem]:
        if not self.problems_dir.is_dir():
            return []
        return [Problem.load(p) for p in sorted(self.problems_dir.iterdir()) if (p / "problem.json").is_file()]

    def store(self, readonly: bool = False) -> Store:
        try:
            return Store(self.store_path, readonly=readonly)
        except StoreError as e:
            raise ProblemError(f"{e}{self._what_to_do(unreadable=True)}") from None

    def tried_candidates(self) -> int:
        """Candidate files the run has saved: evidence that it has tried things."""
        return len(list(self.candidates_dir.glob("*.py"))) if self.candidates_dir.is_dir() else 0

    def check_store(self) -> bool:
        """True if the run has a readable store, False if it has none yet (only profiled).
        A store that is damaged, not a store, or gone (or emptied) while the run has tried
        candidates is a ProblemError: going on would silently start the search over."""
        path = self.store_path
        if path.is_dir():
            raise ProblemError(f"{path} is a directory, not a trial store{self._what_to_do()}")
        empty = not path.exists() or path.stat().st_size == 0
        if empty:
            tried = self.tried_candidates()
            if tried:
                state = "is empty" if path.exists() else "is missing"
                raise ProblemError(f"{path} {state}, but this run has tried {tried} candidates "
                                   f"({self.candidates_dir}){self._what_to_do()}")
            return path.exists()
        try:
            store = Store(path, readonly=True)
        except StoreError as e:
            raise ProblemError(f"{e}{self._what_to_do(unreadable=True)}") from None
        try:
            if store.blank() and not self.tried_candidates():
                return True  # made, its tables never written (the disk filled): like an empty file
            store.check()
        except StoreError as e:
            raise ProblemError(f"{e}{self._what_to_do(unreadable=True)}") from None
        finally:
            store.close()
        return True

    def _what_to_do(self, unreadable: bool = False) -> str:
        # A WAL store cannot be read while its disk is full ("disk I/O error"): that is no damage,
        # and the usual advice (a backup, a new run) would have a user throw away a good store.
        if unreadable and (free := free_bytes(self.store_path.parent)) is not None and free < FULL_BELOW:
            return (f": no space left on its disk ({free} bytes free); free some space and run this again "
                    f"(nothing in {self.path} was changed)")
        try:
            model = self.info().model_file
        except ProblemError:
            model = "MODEL"
        return (f": restore {self.store_path.name} from a backup, or start a new run with agent tune --model "
                f"{model} (nothing in {self.path} was changed)")

    def lock(self) -> "RunLock":
        return RunLock(self.path / LOCK_FILE)

    def save_candidate(self, source: str, digest: str) -> Path:
        """The run's copy of a candidate, by hash. Written whole or not at all (a kill during
        the write leaves no half file for a resume to run), and rewritten if what is there is
        not this source."""
        self.candidates_dir.mkdir(exist_ok=True)
        path = self.candidates_dir / f"{digest}.py"
        try:
            if path.read_text() == source:
                return path
        except (OSError, UnicodeDecodeError):
            pass
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(source)
        tmp.replace(path)
        return path


class RunLock:
    """One tuner per run. An exclusive `flock` on runs/<run>/tune.lock, held while the tuner
    lives: the kernel releases it when the process dies however it dies, so a lock left by a
    killed tuner is simply taken over (and said so). The file keeps the holder's pid and start
    time for the refusal message and for `agent status`; it is emptied, never removed, on
    release (removing it would let two tuners lock two different files)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fd: int | None = None
        self.took_over: str = ""
        """The previous holder's description, when it had died without releasing the file."""

    def acquire(self) -> "RunLock":
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ProblemError(f"{self.path.parent}: cannot write the run's lock file ({e.strerror}); "
                               "the run folder must be writable to tune it") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
            os.close(fd)
            raise RunBusy(f"{self.path.parent} is being tuned by another process ({holder or 'pid unknown'}): "
                          "wait for it, or stop it first (Ctrl-C or kill -TERM on that pid)") from None
        previous = os.pread(fd, 200, 0).decode(errors="replace").strip()
        self.took_over = previous
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            os.close(self.fd)  # closing drops the flock
            self.fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def lock_holder(run: RunFolder) -> tuple[int | None, str]:
    """(pid, description) of the tuner holding the run, if one is alive; (None, '') if none.
    Read from the lock file without locking, so `status` never gets in a tuner's way."""
    try:
        text = (run.path / LOCK_FILE).read_text().strip()
    except OSError:
        return None, ""
    parts = text.split()
    if len(parts) < 2 or parts[0] != "pid" or not parts[1].isdigit():
        return None, ""
    pid = int(parts[1])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None, ""
    except PermissionError:
        pass
    return pid, text


def clean_stale_worker_dirs(min_age_s: float = 10.0) -> int:
    """Remove sandbox workers' private temp folders that no live process uses: those a killed
    tuner's workers left behind. A folder is in use while some process works in it, has a file
    open in it or names it on its command line (a sandbox that binds it elsewhere); folders
    younger than `min_age_s` are left alone, since a worker being started has its folder a
    moment (milliseconds) before its process. Returns how many were removed."""
    root = Path(tempfile.gettempdir())
    try:
        dirs = [d for d in root.iterdir() if d.name.startswith(WORKER_DIR_PREFIX) and d.is_dir()
                and d.stat().st_uid == os.getuid()]
    except OSError:
        return 0
    if not dirs:
        return 0
    used = _paths_in_use(str(root))
    if used is None:  # no /proc to ask: only what is surely abandoned
        min_age_s, used = max(min_age_s, 86400.0), []
    removed, now = 0, time.time()
    for d in dirs:
        try:
            here = str(d.resolve())
            if any(u == here or u.startswith(here + os.sep) for u in used) or now - d.stat().st_mtime < min_age_s:
                continue
        except OSError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed += not d.exists()
    return removed


def _paths_in_use(under: str) -> list[str] | None:
    """Paths under `under` that live processes use: working directories, roots, open files and
    command-line arguments (None where there is no /proc)."""
    proc = Path("/proc")
    if not (proc / "self" / "cwd").exists():
        return None
    out = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        links = [entry / "cwd", entry / "root"]
        try:
            links += list((entry / "fd").iterdir())
        except OSError:
            pass
        for link in links:
            try:
                target = os.readlink(link)
            except OSError:
                continue
            if target.startswith(under):
                out.append(target)
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        out += [a.decode(errors="replace") for a in args if under.encode() in a]
    return [a for path in out for a in path.replace("=", " ").replace(":", " ").split() if a.startswith(under)]
