"""A run folder damaged on disk: its store truncated, overwritten, emptied, deleted, replaced by
a folder or by another SQLite file. Every command that reads the run says so in one line that
names the file and what to do, exits 2, and changes nothing: never a traceback, never a silent
new store that would run the whole search again."""

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "models" / "tiny_rmsnorm.py"
CANDIDATE = ROOT / "tests" / "candidates" / "rmsnorm_triton.py"


def agent(*args, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.fixture(scope="module")
def tuned(tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("damaged")
    result = agent("tune", "--model", TINY, "--runs-dir", runs, "--max-candidates", 2, "--devices", "cpu",
                   "--no-integrate", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    return Path(json.loads(result.stdout)["run"])


def _damage(store: Path, kind: str) -> None:
    for extra in (store.with_name(store.name + "-wal"), store.with_name(store.name + "-shm")):
        extra.unlink(missing_ok=True)
    if kind == "truncated":
        with open(store, "r+b") as f:
            f.truncate(store.stat().st_size // 2)
    elif kind == "garbage":
        store.write_bytes(os.urandom(40_000))
    elif kind == "empty":
        store.write_bytes(b"")
    elif kind == "deleted":
        store.unlink()
    elif kind == "a directory":
        store.unlink()
        store.mkdir()
    elif kind == "blank":  # an SQLite file with no table, as a full disk leaves one being made
        store.unlink(missing_ok=True)
        db = sqlite3.connect(store)
        db.execute("PRAGMA journal_mode=WAL")
        db.close()
    elif kind == "another database":
        store.unlink()
        db = sqlite3.connect(store)
        db.execute("CREATE TABLE notes (text TEXT)")
        db.commit()
        db.close()


KINDS = ["truncated", "garbage", "empty", "deleted", "a directory", "another database", "blank"]
COMMANDS = {"tune --resume": ["tune", "--resume", "{run}", "--no-integrate"], "status": ["status", "{run}"],
            "report": ["report", "{run}"], "try": ["try", "{run}", CANDIDATE], "apply": ["apply", "{run}"]}


def _tree(folder: Path) -> dict[str, bytes | None]:
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.name.endswith(("-wal", "-shm")):
            continue
        out[str(p.relative_to(folder))] = p.read_bytes() if p.is_file() else None
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", COMMANDS)
def test_a_damaged_store_is_named_and_nothing_changes(tuned, tmp_path, kind, command):
    run = tmp_path / "run"
    shutil.copytree(tuned, run)
    _damage(run / "trials.sqlite", kind)
    before = _tree(run)
    result = agent(*[str(a).replace("{run}", str(run)) for a in COMMANDS[command]])
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-2000:])
    assert "Traceback" not in result.stderr + result.stdout
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert str(run / "trials.sqlite") in lines[0] and "restore" in lines[0] and "agent tune --model" in lines[0]
    assert _tree(run) == before, "a command changed a run whose store it could not read"


def test_a_profiled_run_without_a_store_is_no_error(tuned, tmp_path):
    """Only profiled (no candidate tried yet): no store is the normal state, not damage."""
    run = tmp_path / "run"
    shutil.copytree(tuned, run, ignore=shutil.ignore_patterns("trials.sqlite*", "candidates", "report*"))
    result = agent("status", run, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["state"] == "not started"


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MB file system of its own (a tmpfs: root with mount rights, as on CI), unmounted after."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small file system here (needs root with mount rights)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_store_on_a_full_disk_is_not_called_damaged(tuned, small_disk):
    """A WAL store cannot be opened while its disk is full and its -shm file must be made again
    ("disk I/O error"). The advice for damage (restore a backup, start a new run) would have a
    user throw a good store away: the message names the full disk, and once there is room the
    same command reads every trial."""
    run = small_disk / "run"
    shutil.copytree(tuned, run)
    (run / "trials.sqlite-shm").unlink(missing_ok=True)
    _fill(small_disk)
    full = agent("status", run)
    assert full.returncode == 2, (full.stdout[-2000:], full.stderr[-2000:])
    lines = [ln for ln in full.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "no space left on its disk" in lines[0] and "backup" not in lines[0], full.stderr
    (small_disk / "filler").unlink()
    again = agent("status", run, "--json")
    assert again.returncode == 0, again.stderr[-2000:]
    assert sum(r["trials"] for r in json.loads(again.stdout)["regions"]) == 2


def test_a_tune_on_a_full_disk_ends_in_one_line(small_disk):
    """The disk filled before the run could be made: the error names the full disk (a write
    that fails as its file closes names no file); no traceback, exit 2."""
    _fill(small_disk)
    result = agent("tune", "--model", TINY, "--runs-dir", small_disk / "runs", "--max-candidates", 1, "--devices", "cpu",
                   "--no-integrate")
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-2000:])
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    last = [ln for ln in result.stderr.splitlines() if ln.strip()][-1]  # torch's profiler may complain first
    assert last.startswith("error: ") and "no space left" in last and "free some space" in last, result.stderr


def test_a_store_a_full_disk_left_without_tables_is_no_damage(tuned, tmp_path):
    """The disk filled as the store was made, after the problems were frozen: an SQLite file with
    no table. With no candidate tried it is a store not yet written, not damage: the frozen run
    resumes (with candidates tried, the same file is damage: see KINDS)."""
    run = tmp_path / "run"
    shutil.copytree(tuned, run, ignore=shutil.ignore_patterns("trials.sqlite*", "candidates", "report*"))
    _damage(run / "trials.sqlite", "blank")
    status = agent("status", run, "--json")
    assert status.returncode == 0, status.stderr[-2000:]
    assert json.loads(status.stdout)["state"] == "not started"
    resumed = agent("tune", "--resume", run, "--max-candidates", 1, "--no-integrate", "--json")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert sum(r["trials"] for r in json.loads(agent("status", run, "--json").stdout)["regions"]) == 1


def _fill(disk: Path) -> None:
    with open(disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass
