"""Ctrl-C, SIGTERM and SIGHUP all mean stop. Outside the search (which stops cleanly on its own,
agent/search/tuning.py) the first of them kills every sandbox worker this process started and raises
KeyboardInterrupt, so every command unwinds the same way: half-made run folders removed, exit
130; any later one is ignored while that happens (`stopping`). Under `nohup` a hangup stays
ignored, as nohup asked."""

from __future__ import annotations

import os
import signal
import stat
from contextlib import contextmanager

STOP_SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}


_HUNG_UP: list[bool] = []
"""Whether a hangup detached the terminal (code that had saved a descriptor may have put it back)."""


def detach_from_terminal() -> None:
    """After a hangup the terminal is gone and every write to it fails (EIO: the command's last
    lines ended in an error, or a traceback, instead of exit 130). What is left to say goes to
    runs/<run>/log.txt only. A hung-up terminal no longer answers isatty, so every character
    device among the output descriptors (the terminal; /dev/null aside) is replaced."""
    from agent.json_stdout import json_fds
    _HUNG_UP.append(True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        null = os.fstat(devnull)
        for fd in (1, 2, *json_fds()):
            try:
                st = os.fstat(fd)
                if stat.S_ISCHR(st.st_mode) and not os.path.samestat(st, null):
                    os.dup2(devnull, fd)
            except OSError:
                pass
    finally:
        os.close(devnull)


_STOPPING: list[bool] = []


def stopping() -> None:
    """The command is ending already (an interrupt is being handled, or the process exits): a
    second Ctrl-C or SIGTERM there cut the cleanup short (no resume line, integration's workers
    left to the exit) or landed in the interpreter's exit, which then killed itself with SIGINT
    (exit -2, Ctrl-C typed twice while profiling). From here they are ignored for good, and a
    hangup only detaches the terminal (again, where one came: the profiler's stderr filter puts
    the terminal back as it ends). Main thread only."""
    if _HUNG_UP:
        detach_from_terminal()
    _STOPPING.append(True)
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
            signal.signal(signal.SIGHUP, lambda signum, frame: detach_from_terminal())
    except ValueError:  # not the main thread
        pass


def is_stopping() -> bool:
    """A stop signal is being handled: its handlers must not be put back."""
    return bool(_STOPPING)


@contextmanager
def signals_as_interrupts():
    def interrupt(signum, frame):
        from sandbox.client import stop_all
        if signum == signal.SIGHUP:
            detach_from_terminal()
        stopping()
        stop_all(from_signal=True)  # before unwinding: code that catches the interrupt must not keep workers alive
        raise KeyboardInterrupt(STOP_SIGNALS.get(signum, f"signal {signum}"))

    previous = {}
    try:
        for sig in STOP_SIGNALS:
            old = signal.getsignal(sig)
            if not (sig == signal.SIGHUP and old is signal.SIG_IGN):
                previous[sig] = old
                signal.signal(sig, interrupt)
    except ValueError:  # not the main thread: signals are not ours to take
        pass
    try:
        yield
    finally:
        for sig, old in previous.items() if not is_stopping() else ():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
