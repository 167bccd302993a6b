"""What a command prints: stdout (a plain line, never rich markup), the one `error:` line a bad
input gets, and the guard that turns the library's user-facing errors into that line and its
exit code."""

from __future__ import annotations

import sqlite3
import sys
from functools import wraps

import typer
from pydantic import ValidationError
from rich.console import Console

out = Console(width=None if sys.stdout.isatty() else 150)
err = Console(stderr=True)
PLAIN = {"markup": False, "highlight": False, "soft_wrap": True}


def fail(message: str, code: int = 2) -> None:
    err.print(f"error: {' '.join(message.split())}", **PLAIN)  # one line, however long
    raise typer.Exit(code)


def say(text: str) -> None:
    out.print(text, **PLAIN)


def guard(fn):
    """Turn the library's user-facing errors into one line and exit code 2."""
    @wraps(fn)
    def wrapper(*args, **kwargs):
        from agent.errors import UserError, os_error_line
        from tools.modelfile import ModelFileError
        from tools.problem import ProblemError
        from tools.store import StoreError
        try:
            return fn(*args, **kwargs)
        except (UserError, ModelFileError, ProblemError, StoreError) as e:
            fail(str(e))
        except ValidationError as e:
            fail("; ".join(validation_text(x) for x in e.errors()))
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (agent/search/signals.py)
            from agent.search.signals import stopping
            from sandbox.client import stop_all
            stopping()
            stop_all()  # what a start under way was launching goes too, before the exit line
            fail(f"interrupted ({str(e) or 'Ctrl-C'}); nothing half-made was kept", 130)
        except OSError as e:  # the file system said no: name the file, not the line of code
            fail(os_error_line(e))
        except sqlite3.Error as e:
            fail(f"the run's store: {e}")
    return wrapper


def validation_text(error: dict) -> str:
    """Our validators already name the field; pydantic's own messages do not."""
    msg = error["msg"].removeprefix("Value error, ")
    field = ".".join(map(str, error["loc"]))
    return msg if field and msg.startswith(field) else f"{field}: {msg}"
