"""The run's seal: the sha256 of every frozen file, written when it is frozen, checked
wherever it is read.

`runs/<run>/seal.json` maps each frozen file's path (relative to the run folder: every
problem's `problem.json`, inputs, references and state, and the whole model's) to its hash.
`problem.json` holds the tolerance and the hashes of the tensor files, so sealing it makes an
edited tolerance an error rather than a quietly looser run. Sandbox workers never see the run
folder (sandbox/jail.py), so candidate code cannot rewrite a file and its seal together.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from tools import strict_json

SEAL_FILE = "seal.json"


class SealError(ValueError):
    """A frozen file that does not match its seal, or a run without one."""


_known: dict[tuple, str] = {}


def file_hash(path: Path) -> str:
    """sha256 of a file; remembered per (path, inode, size, mtime) in this process, since the
    same frozen files (gigabytes for large problems) are checked by every runner."""
    st = os.stat(path)
    key = (str(Path(path).resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
    if key in _known:
        return _known[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    _known[key] = h.hexdigest()
    return _known[key]


def root_of(problem_folder: Path) -> Path:
    """Where a problem folder's seal lives: the nearest of its parent and grandparent that has
    one (`runs/<run>/model/` -> the run; `runs/<run>/problems/<name>/` -> the run)."""
    for up in (Path(problem_folder).parent, Path(problem_folder).parent.parent):
        if (up / SEAL_FILE).is_file():
            return up
    return Path(problem_folder).parent.parent


def _read(run: Path) -> dict[str, str]:
    path = Path(run) / SEAL_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SealError(f"{path}: unreadable seal ({e}); the run's frozen files cannot be trusted") from None
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise SealError(f"{path}: malformed seal; the run's frozen files cannot be trusted")
    return data


def record(run: Path, files: list[Path]) -> None:
    """Add (or renew, at freeze time only) the hashes of `files` to the run's seal."""
    run = Path(run)
    seal = _read(run)
    for f in files:
        seal[os.path.relpath(Path(f).resolve(), run.resolve())] = file_hash(Path(f))
    tmp = run / (SEAL_FILE + ".tmp")
    tmp.write_text(strict_json.dumps(seal, indent=1, sort_keys=True))
    tmp.replace(run / SEAL_FILE)


def check(run: Path, path: Path) -> None:
    """Raise SealError unless `path` has the hash the seal recorded for it."""
    run = Path(run)
    seal = _read(run)
    rel = os.path.relpath(Path(path).resolve(), run.resolve())
    if not seal:
        raise SealError(f"{run}: no {SEAL_FILE}, so {rel} cannot be checked (frozen by an older nightshift, "
                        "or the seal was deleted): profile the model again")
    if rel not in seal:
        raise SealError(f"{Path(path)} is not in the run's seal: it was not frozen with this run")
    if seal[rel] != file_hash(Path(path)):
        raise SealError(f"{Path(path)} changed since it was frozen (its hash no longer matches {run / SEAL_FILE}); "
                        "an edited tolerance or reference is never used: profile again to freeze new problems")
