"""A sandbox worker's start before and after the fork server, on this machine: wall seconds to
the worker's hello and the CPU seconds its processes spent to get there, median of N starts.

    python bench/worker_start.py [--n=10] [--device=cpu] [--role=candidate|reference]

Rows:
- exec: `NIGHTSHIFT_FORK_WORKERS=0`, bubblewrap and a fresh interpreter that imports torch (the
  path every worker took before the fork server);
- forked, one-off: a fork server started for this one worker and ended with it (what a
  configuration used once pays);
- forked, server running: a worker forked from a server that is already up (every later worker
  of a configuration, and every worker started ahead while the model is frozen).

CPU seconds are read from /proc at the hello, for every process of the worker (bubblewrap's outer
process, or the setup process the fork server forked, and the jail's or namespace's init and the
worker), their reaped children included. For the one-off row the fork server's own start (its
bubblewrap and its imports) is added; it is shown apart as well. The machine's load is printed
with the table: compare rows of one run only.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sandbox import jail, procs, zygotes  # noqa: E402
from sandbox.client import Worker, WorkerConfig  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: set[int]) -> float:
    total = 0
    for pid in pids:
        try:
            rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(v) for v in rest[11:15])  # utime, stime, cutime, cstime
    return total / TICK


def worker_cpu(w: Worker) -> float:
    return cpu_seconds({w.proc.pid} | w.members())


def server_cpu() -> float:
    """Every fork server's own processes: bubblewrap's outer one, its jail's init and the server."""
    pids: set[int] = set()
    for z in list(zygotes._ZYGOTES.values()):
        first, _ = procs.pid_namespace(z.proc.pid)
        pids |= {z.proc.pid} | ({first, *(procs.children(first) or [])} if first else set())
    return cpu_seconds(pids)


def one(cfg: WorkerConfig) -> tuple[float, float, float]:
    """(wall to hello, the worker's CPU seconds, its fork server's CPU seconds if it started one)."""
    w = Worker(cfg)
    running = zygotes.running()
    t0 = time.monotonic()
    reply = w.start()
    wall = time.monotonic() - t0
    if not reply.ok:
        raise SystemExit(f"the worker did not start: {reply.error}")
    cpu, server = worker_cpu(w), (server_cpu() if running == 0 and zygotes.running() else 0.0)
    w.close()
    return wall, cpu, server


def row(name: str, samples: list[tuple[float, float, float]]) -> str:
    wall = statistics.median(s[0] for s in samples)
    cpu = statistics.median(s[1] + s[2] for s in samples)
    server = statistics.median(s[2] for s in samples)
    return f"| {name} | {wall:.3f} | {cpu:.3f} | {server:.3f} | {len(samples)} |"


def main() -> None:
    n = int(next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--n=")), 10))
    device = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--device=")), "cpu")
    role = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--role=")), "candidate")
    cfg = WorkerConfig(device=device, role=role)
    if jail.describe().kind != "bubblewrap":
        raise SystemExit(f"no jail here: {jail.describe().note}")
    os.environ[jail.FORK_ENV] = "0"
    execs = [one(cfg) for _ in range(n)]
    os.environ[jail.FORK_ENV] = "1"
    if jail.forking():
        raise SystemExit(f"no fork server here: {jail.forking()}")
    one_offs = [one(cfg) for _ in range(n)]
    keeper = Worker(cfg)  # holds the server up between the starts below
    assert keeper.start().ok
    warm = [one(cfg) for _ in range(n)]
    keeper.close()
    load = os.getloadavg()
    print(f"{role} worker start on {os.cpu_count()} CPUs, device {device}, Python {sys.version.split()[0]}, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print("| start | wall to hello, s (median) | CPU s (median) | of which the fork server's | starts |")
    print("|---|---|---|---|---|")
    print(row("exec (NIGHTSHIFT_FORK_WORKERS=0)", execs))
    print(row("forked, one-off (its server started for it)", one_offs))
    print(row("forked, server running", warm))


if __name__ == "__main__":
    main()
