"""EXPECT: ok -- lists /proc and sends SIGSTOP, SIGTERM and SIGKILL to every process it can see
but itself (its init, a sibling worker, the fork server, the tuner, were they visible), and
tries every pid up to 4,096 by number; it raises if any process but its own namespace's answers.
A forked worker sees only its own pid namespace: pid 1 (its init, which takes no signal from
inside) and itself, so nothing outside is touched (tests/test_forkserver.py checks the sibling
and the fork server after it)."""
import os
import signal


def forward(module, x):
    seen = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    mine = {1, os.getpid()}
    own_threads = {int(t) for t in os.listdir("/proc/self/task")}  # a signal to one is a signal to itself
    reached = []
    for pid in range(1, 4097):
        if pid == os.getpid() or pid in own_threads:
            continue
        for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGKILL):
            try:
                os.kill(pid, sig)
                if pid not in mine:
                    reached.append(pid)
            except OSError:
                pass
    if set(seen) - mine or reached:
        raise RuntimeError(f"processes beyond its own namespace: listed {seen}, signalled {sorted(set(reached))}")
    return type(module).forward(module, x)
