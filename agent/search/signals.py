"""SIGTERM and SIGHUP mean what Ctrl-C means: stop. Outside the search (which stops cleanly on
its own, agent/search/tuning.py) they kill every sandbox worker this process started, then raise
KeyboardInterrupt, as SIGINT does, so every command unwinds the same way: half-made run folders
removed, exit 130. Under `nohup` a hangup stays ignored, as nohup asked."""

from __future__ import annotations

import signal
from contextlib import contextmanager

STOP_SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}


@contextmanager
def signals_as_interrupts():
    def interrupt(signum, frame):
        from sandbox.client import stop_all
        stop_all(from_signal=True)  # before unwinding: code that catches the interrupt must not keep workers alive
        raise KeyboardInterrupt(STOP_SIGNALS.get(signum, f"signal {signum}"))

    previous = {}
    try:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            old = signal.getsignal(sig)
            if not (sig == signal.SIGHUP and old is signal.SIG_IGN):
                previous[sig] = old
                signal.signal(sig, interrupt)
    except ValueError:  # not the main thread: signals are not ours to take
        pass
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
