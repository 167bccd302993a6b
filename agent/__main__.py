"""`python -m agent` and the `agent` console script: the command line, then the process's end (`end`)."""

import atexit
import ctypes
import os
import sys
import threading
import time
import traceback

from agent.cli.main import main
from agent.search.signals import stopping


# How long the exit after an interrupt may wait for other threads; the environment may shorten it
# (the test of that last resort does not wait 20 s for it).
EXIT_AFTER_INTERRUPT_S = float(os.environ.get("NIGHTSHIFT_EXIT_AFTER_INTERRUPT_S") or 20.0)


def _interrupt_handled() -> None:
    """A KeyboardInterrupt raised inside code that C code ran as a string (PyRun_String and the like;
    which call the SIGTERM landed in was not found) sets CPython's flag for an unhandled one even
    when a command caught it; after finalizing, the interpreter then killed itself with SIGINT instead of
    exiting with the code chosen here (2 of 40 SIGTERMs at a profile's start, the flag set in both).
    Every exit comes through `end` with its code chosen, so the flag is cleared (CPython 3.11 names
    it; later versions keep it where ctypes cannot reach, and nothing changes there)."""
    try:
        ctypes.c_int.in_dll(ctypes.pythonapi, "_Py_UnhandledKeyboardInterrupt").value = 0
    except (ValueError, AttributeError, OSError):
        pass


def end(code) -> None:
    """The process ends here. A daemon thread still running is unwound by Python 3.11's exit,
    and one inside torch's C++ code then aborts the process ("terminate called without an
    active exception") after the command had written its results. The search's own threads
    (lanes, the progress ticker) are ended before this; what may be left is a planner call
    still waiting on an API. With one alive the exit handlers run (they kill the workers), the
    streams are flushed, and the process ends without finalizing the interpreter. Nothing is
    lost that way: every trial and event was committed to the store when it happened, and
    run.json, the report and the log were written and closed before the command returned."""
    stopping()
    _interrupt_handled()
    if not any(t.daemon and t.is_alive() for t in threading.enumerate()):
        if code == 130:
            _end_within(EXIT_AFTER_INTERRUPT_S, code)
        sys.exit(code)
    _end_now(code)


def _end_now(code) -> None:
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)


def _end_within(seconds: float, code) -> None:
    """After an interrupt the interpreter's exit first waits for every other thread (the ones
    still starting or stopping workers end, then the exit handlers kill what they left), but an
    interrupt can also leave a thread nothing will ever end (started by a thread pool's submit
    that the signal cut short, never registered for the pool's shutdown): it waited for that one
    forever. After `seconds` the exit handlers run here and the process ends."""
    def last_resort() -> None:
        time.sleep(seconds)
        _end_now(code)
    threading.Thread(target=last_resort, daemon=True, name="nightshift-exit").start()


def run() -> None:
    """The `agent` command, as `python -m agent` and as the console script pip installs
    (pyproject.toml): both end through `end`. The script called agent.cli.main directly and
    skipped it, so a tune started as `agent tune` had none of the exit's guards."""
    try:
        main()
    except SystemExit as e:
        end(e.code)
    except KeyboardInterrupt:  # one that no command turned into its own exit
        end(130)
    except BaseException:  # a bug's traceback, then the same end
        traceback.print_exc()
        end(1)


if __name__ == "__main__":
    run()
