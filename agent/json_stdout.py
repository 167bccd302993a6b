"""`--json`: stdout carries the JSON document and nothing else."""

from __future__ import annotations

import os
import sys
from typing import Any

from tools import strict_json

_JSON_FD: list[int] = []
"""The real stdout, once `claim` has sent everything else to stderr."""


def claim(json_out: bool) -> None:
    """With --json, stdout carries the JSON and nothing else: what the model file prints while
    it is loaded and profiled (Python or C) goes to stderr, down to the file descriptor."""
    if not json_out or _JSON_FD:
        return
    sys.stdout.flush()
    _JSON_FD.append(os.dup(1))
    os.dup2(2, 1)


def json_fds() -> list[int]:
    """The descriptor the JSON goes to, once claimed (agent/search/signals.py detaches it after a hangup)."""
    return list(_JSON_FD)


def emit(data: Any) -> None:
    text = strict_json.dumps(data, indent=2, default=str) + "\n"
    if not _JSON_FD:
        sys.stdout.write(text)
        return
    sys.stdout.flush()
    with os.fdopen(os.dup(_JSON_FD[0]), "w") as real:
        real.write(text)
