"""A night's footprint: does the tuner's or a worker's memory, or the run folder, grow per trial?

    python bench/footprint_bench.py [--trials 2000] [--out DIR] [--every 250]

Thousands of real trials on the CPU, as fast as they come honestly: tests/models/tiny_rmsnorm.py
is profiled and frozen (`agent profile`), then `agent tune --resume RUN --planner files --devices cpu
--no-integrate` runs `--trials` candidates an outside agent would drop into the run's inbox: plain
PyTorch forwards (no Triton interpreter, so a trial is a second, not minutes), each one distinct,
most of them right, one in ten wrong, one in twenty raising, one in forty not compiling. Every
trial goes the whole way: the worker imports the candidate and calls it, the tuner verifies its
outputs on every frozen input set, fresh inputs and perturbed parameters, a passing one is timed,
and each is written to the store. The candidate cap is the only stop rule that fires.

Sampled every second while it runs: the trials in the store, the resident memory (RSS) of the
tuner and of each sandbox worker (its Python process inside the jail), the run folder's size on
disk, and the workers' own temp folders. Printed: a row every `--every` trials, then

- memory: the tuner's and the workers' RSS at trial 500 and at the last trial (the median of
  the samples around each), and the change between them;
- disk: the run folder's growth per 1,000 trials over the first half after trial 500 and over
  the second half, and what it is made of (the store, candidate sources, the log, anything else).

Both are flat when they change by less than 10% from the first 500 trials to the last.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "models" / "tiny_rmsnorm.py"
RIGHT = """import torch

def forward(module, x):
    x32 = x.float()
    scale = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + module.eps)  # variant {i}
    return module.weight * (x32 * scale).to(x.dtype)
"""
WRONG = RIGHT.replace("module.eps)", "module.eps) * 1.01")
RAISES = RIGHT.replace("    x32 = x.float()", "    raise RuntimeError('variant {i} gives up')")
BROKEN = RIGHT.replace("def forward(module, x):", "def forward(module, x)")


def candidate(i: int) -> str:
    kind = BROKEN if i % 40 == 7 else RAISES if i % 20 == 3 else WRONG if i % 10 == 5 else RIGHT
    return kind.replace("{i}", str(i))


def agent(*args, stdout=subprocess.PIPE) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-m", "agent", *map(str, args)], cwd=ROOT, env=env,
                            stdout=stdout, stderr=subprocess.STDOUT, text=True)


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def workers_of(tuner: int) -> list[int]:
    """The tuner's sandbox workers: their Python processes (inside the jail, under bubblewrap)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"sandbox.worker" in cmd and b"--parent" in cmd and "python" in os.path.basename(cmd[0].decode()) \
                and cmd[cmd.index(b"--parent") + 1] == str(tuner).encode():
            found.append(int(entry))
    return found


def disk(folder: Path) -> dict[str, int]:
    """Bytes on disk (allocated blocks) under `folder`, by part. The store counts as what it
    holds (its pages, wherever they are yet): its write-ahead log is a sawtooth of up to ~4 MB
    that SQLite empties into the database every 1,000 pages, reported on its own (`wal`)."""
    parts = {"store": store_bytes(folder), "wal": 0, "sources": 0, "inbox": 0, "log": 0, "other": 0}
    for dirpath, _, files in os.walk(folder):
        for f in files:
            path = Path(dirpath) / f
            try:
                size = path.stat().st_blocks * 512
            except OSError:
                continue
            rel = path.relative_to(folder)
            part = ("wal" if f.startswith("trials.sqlite-") else None if f == "trials.sqlite"
                    else "sources" if rel.parts[0] == "candidates" else "inbox" if rel.parts[0] == "inbox"
                    else "log" if f == "log.txt" else "other")
            if part:
                parts[part] += size
    return parts


def store_bytes(run: Path) -> int:
    try:
        db = sqlite3.connect(f"file:{run / 'trials.sqlite'}?mode=ro", uri=True, timeout=5)
        try:
            return db.execute("PRAGMA page_count").fetchone()[0] * db.execute("PRAGMA page_size").fetchone()[0]
        finally:
            db.close()
    except sqlite3.Error:
        return 0


def worker_temp_bytes() -> int:
    total = 0
    for d in Path(tempfile.gettempdir()).glob("nightshift-worker-*"):
        for dirpath, _, files in os.walk(d):
            for f in files:
                try:
                    total += (Path(dirpath) / f).stat().st_blocks * 512
                except OSError:
                    pass
    return total


def trials_in(run: Path) -> int:
    try:
        db = sqlite3.connect(f"file:{run / 'trials.sqlite'}?mode=ro", uri=True, timeout=5)
        try:
            return db.execute("SELECT COUNT(*) FROM trials").fetchone()[0]
        finally:
            db.close()
    except sqlite3.Error:
        return 0


def around(samples: list[dict], trial: int, key: str, width: int = 50) -> float:
    near = [s[key] for s in samples if abs(s["trials"] - trial) <= width and s[key]]
    return statistics.median(near) if near else 0.0


def at(samples: list[dict], trial: int) -> dict:
    return min(samples, key=lambda s: abs(s["trials"] - trial))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--every", type=int, default=250)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="footprint-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    profiled = agent("profile", "--model", TINY, "--runs-dir", out / "runs", "--json")
    text, _ = profiled.communicate()
    run = Path(json.loads(text[text.index("{"):])["run"])
    inbox = run / "inbox" / "RMSNorm"
    inbox.mkdir(parents=True)
    for i in range(args.trials):
        (inbox / f"{i:05d}.py").write_text(candidate(i))
    command = ["tune", "--resume", run, "--planner", "files", "--devices", "cpu", "--no-integrate",
               "--max-candidates", args.trials, "--patience", 10 * args.trials, "--gpu-hours", 100]
    print(f"{time.strftime('%Y-%m-%d %H:%M')}  agent {' '.join(map(str, command))}", flush=True)
    with open(out / "tune.txt", "w") as log:
        tuner = agent(*command, stdout=log)
    samples: list[dict] = []
    t0, next_row = time.monotonic(), args.every
    print(f"{'trials':>6} {'min':>5} {'tuner MB':>9} {'workers MB':>11} {'run folder MB':>14} {'store':>7} "
          f"{'wal':>5} {'sources':>8} {'inbox':>6} {'log':>5} {'other':>6} {'worker tmp MB':>14}", flush=True)
    while tuner.poll() is None:
        time.sleep(1.0)
        parts = disk(run)
        workers = workers_of(tuner.pid)
        s = {"trials": trials_in(run), "tuner": rss_mb(tuner.pid), "workers": [rss_mb(w) for w in workers],
             "disk": sum(v for k, v in parts.items() if k != "wal"), "parts": parts, "tmp": worker_temp_bytes()}
        s["worker_sum"] = sum(s["workers"])
        samples.append(s)
        if s["trials"] >= next_row:
            mb = 1 << 20
            print(f"{s['trials']:>6} {(time.monotonic() - t0) / 60:>5.1f} {s['tuner']:>9.0f} "
                  f"{' + '.join(f'{w:.0f}' for w in s['workers']):>11} {s['disk'] / mb:>14.2f} "
                  f"{parts['store'] / mb:>7.2f} {parts['wal'] / mb:>5.2f} {parts['sources'] / mb:>8.2f} "
                  f"{parts['inbox'] / mb:>6.2f} {parts['log'] / mb:>5.2f} "
                  f"{parts['other'] / mb:>6.2f} {s['tmp'] / mb:>14.2f}", flush=True)
            next_row += args.every
    code = tuner.wait()
    last = trials_in(run)
    parts = disk(run)
    samples.append({**samples[-1], "trials": last, "disk": sum(v for k, v in parts.items() if k != "wal"),
                    "parts": parts})
    print(f"\nagent tune exited {code}; {last} trials in {(time.monotonic() - t0) / 60:.1f} min "
          f"({(time.monotonic() - t0) / max(1, last):.2f} s a trial); run folder {run}")
    if last < 1000:
        print("fewer than 1,000 trials: nothing to compare")
        return
    first, end = 500, last
    mid = (first + end) // 2
    print(f"\nmemory (RSS, median of the samples within 50 trials), trial {first} -> trial {end}:")
    for key, name in (("tuner", "tuner"), ("worker_sum", "workers (sum)")):
        a, b = around(samples, first, key), around(samples, end - 50, key)
        print(f"  {name:<14} {a:8.1f} MB -> {b:8.1f} MB   {100 * (b - a) / a:+.1f}%"
              f"   ({1000 * (b - a) / (end - 50 - first):+.2f} MB per 1,000 trials)")
    s0, s1, s2 = at(samples, first), at(samples, mid), samples[-1]
    seg1 = 1000 * (s1["disk"] - s0["disk"]) / max(1, s1["trials"] - s0["trials"])
    seg2 = 1000 * (s2["disk"] - s1["disk"]) / max(1, s2["trials"] - s1["trials"])
    print(f"disk (run folder) growth per 1,000 trials: trials {s0['trials']}-{s1['trials']} {seg1 / 2**20:.2f} MB, "
          f"trials {s1['trials']}-{s2['trials']} {seg2 / 2**20:.2f} MB   {100 * (seg2 - seg1) / seg1:+.1f}%")
    per = {k: (s2["parts"][k] - s0["parts"][k]) / max(1, s2["trials"] - s0["trials"])
           for k in s2["parts"] if k != "wal"}
    print("  per trial: " + ", ".join(f"{k} {v / 1024:.2f} KB" for k, v in per.items())
          + f"; whole run folder at the end {s2['disk'] / 2**20:.1f} MB for {last} trials; the store's "
          f"write-ahead log at most {max(x['parts']['wal'] for x in samples) / 2**20:.1f} MB")


if __name__ == "__main__":
    main()
