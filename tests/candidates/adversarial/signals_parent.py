"""EXPECT: ok|crash -- sends SIGKILL and SIGINT to its parent and to every process it can see;
in the jail it sees only its own namespace, and the tuner never gets a signal."""
import os
import signal


def forward(module, x):
    for sig in (signal.SIGINT, signal.SIGKILL):
        try:
            os.kill(os.getppid(), sig)
        except OSError:
            pass
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        if pid not in (os.getpid(), 1):
            try:
                os.kill(pid, signal.SIGINT)
            except OSError:
                pass
    return type(module).forward(module, x)
