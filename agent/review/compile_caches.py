"""Inductor's and Triton's caches carried from a compile baseline to the ways that compile our
kernels in the same mode.

Every worker compiles into an empty cache of its own (a shared one could be poisoned), so the
way "nightshift + max-autotune" compiled and autotuned again, for minutes, what the
max-autotune baseline of the same model had just done. Here each compile baseline (the
untouched model: no candidate code runs in its worker) fills its mode's folder in the run, and
a way with our kernels starts from a copy of it, deleted when integration ends: what candidate
code writes never reaches a baseline, whose speed is the rival's. The baselines' folders stay in the run
(beside its frozen tensors they are small): integrating the run again compiles from them too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from agent.flags import BASELINES

FOLDER = "compile_cache"
"""The baselines' caches, in the run folder (hidden from every worker, this one bound back)."""


class CompileCaches:
    def __init__(self, run_path: Path):
        self.root = Path(run_path) / FOLDER
        self.copies: dict[str, str] = {}
        """Way -> the folder holding its latest copy (deleted by `drop_copies`)."""
        self.said: dict[str, str] = {}
        """Way -> where its latest copy came from and its size, for the progress log."""

    def folder(self, way: str) -> tuple[str, str] | None:
        """(the cache folder a worker running `way` compiles in, the path its jail shows it at),
        None: its own, empty one. A copy is shown at its baseline's path: Triton's and Inductor's
        files name each other by absolute path (a group file lists its kernel's files), so a copy
        seen elsewhere sends the worker to the baseline's folder, hidden in its jail (every way
        with our kernels failed so on the H100, 2026-12-06). A way with our kernels run again
        (integration's reroute, or after its winners were routed in one by one) starts from what
        it compiled the first time, which holds the baseline's too: a cache its candidate code
        wrote only ever reaches that same way, verified and timed again, never a baseline."""
        if way in BASELINES:
            own = str(self._own(way))
            return own, own
        base = next((b for b in BASELINES if way == f"nightshift + {b}"), None)
        if base is None:
            return None
        earlier = self.copies.get(way)
        source = Path(earlier, "cache") if earlier else self.root / base
        outer = tempfile.mkdtemp(prefix="nightshift-cache-")  # 0700: nobody else reaches the copy
        copy = os.path.join(outer, "cache")
        try:
            # A baseline still compiling renames files meanwhile: what could not be copied is compiled.
            shutil.copytree(source, copy, symlinks=True) if source.is_dir() else os.mkdir(copy)
        except (shutil.Error, OSError):
            os.makedirs(copy, exist_ok=True)
        _writable_by_all(copy)
        if earlier:
            shutil.rmtree(earlier, ignore_errors=True)  # its worker is closed: the new copy holds it all
        self.copies[way] = outer
        size = sum(f.stat().st_size for f in Path(copy).rglob("*") if f.is_file() and not f.is_symlink())
        origin = "its own first compile's" if earlier else f"the {base} baseline's"
        self.said[way] = f"{way} compiles from a copy of {origin} cache ({size / 2**20:.0f} MB)"
        return copy, str(self.root / base)

    def _own(self, way: str) -> Path:
        folder = self.root / way
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        _writable_by_all(str(folder))
        return folder

    def drop_copies(self) -> None:
        """Every copy deleted (integration has ended)."""
        for outer in self.copies.values():
            shutil.rmtree(outer, ignore_errors=True)
        self.copies.clear()


def _writable_by_all(folder: str) -> None:
    """A jailed worker started by root runs as `nobody`: it must write here, and in what an
    earlier worker (or the copy, made by this process) left."""
    for path, dirs, files in os.walk(folder):
        with contextlib.suppress(OSError):
            os.chmod(path, 0o777)
        for f in files:
            with contextlib.suppress(OSError):
                full = os.path.join(path, f)
                if not os.path.islink(full):
                    os.chmod(full, 0o666 | (os.stat(full).st_mode & 0o111))
