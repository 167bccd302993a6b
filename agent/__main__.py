import atexit
import os
import sys
import threading
import traceback

from agent.cli import main


def end(code) -> None:
    """The process ends here. A daemon thread still running (a planner call left waiting, a
    preload) is unwound by Python 3.11's exit, and one inside torch's C++ code then aborts the
    process ("terminate called without an active exception") after the command had written
    its results. An interrupt can leave a thread that nothing will ever end (one started by a
    thread pool's submit that the signal cut short, never registered for the pool's shutdown),
    and the interpreter's exit waited for it forever. So with a daemon thread alive, or after an
    interrupt: the exit handlers run, the streams are flushed, and the process ends without
    finalizing the interpreter."""
    if code != 130 and not any(t.daemon and t.is_alive() for t in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)


try:
    main()
except SystemExit as e:
    end(e.code)
except KeyboardInterrupt:  # one that no command turned into its own exit
    end(130)
except BaseException:  # a bug's traceback, then the same end
    traceback.print_exc()
    end(1)
