"""JSON that strict parsers read: every file the tool writes and every `--json` document.

Python's `json` writes a non-finite float as the bare words NaN, Infinity and -Infinity, which
are not JSON (JavaScript's JSON.parse, jq and Go refuse them), and pydantic writes it as null,
which loses the value. Here it is the string "NaN", "Infinity" or "-Infinity": a pydantic float
field reads those back as the float (as pydantic's own `ser_json_inf_nan="strings"` writes them).
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel


def _word(x: float) -> str:
    return "NaN" if math.isnan(x) else "Infinity" if x > 0 else "-Infinity"


def plain(obj: Any) -> Any:
    """`obj` with every non-finite float replaced by its string, models as their JSON data."""
    if isinstance(obj, BaseModel):
        obj = obj.model_dump(mode="json")
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else _word(obj)
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """json.dumps of `plain(obj)`; raises rather than write a bare NaN (allow_nan=False)."""
    return json.dumps(plain(obj), allow_nan=False, **kwargs)
