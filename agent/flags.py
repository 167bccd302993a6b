"""What a command line says, checked before anything heavy is imported: a wrong flag is named in
under a second, not after torch's few seconds of import (and never after the model was built)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from agent.errors import UserError
from tools.modelfile import check_model_path
from tools.problem import Tolerance
from tools.runfolder import check_runs_dir


BASELINES: dict[str, str | None] = {"torch.compile": None,
                                    "max-autotune-no-cudagraphs": "max-autotune-no-cudagraphs",
                                    "reduce-overhead": "reduce-overhead"}
"""The compile baselines: name -> torch.compile mode (None: the default mode)."""


def parse_compile_modes(text: str | None) -> list[str] | None:
    """--compile-modes: names of BASELINES, comma-separated, or `all` (None: all)."""
    if text is None or text.strip() == "all":
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in BASELINES for n in names):
        raise UserError(f"--compile-modes {text!r}: name one or more of {', '.join(BASELINES)} (comma-separated), "
                        "or all")
    return [n for n in BASELINES if n in names]


@dataclass
class FreezeFlags:
    tolerance: Tolerance | None = None
    e2e_tolerance: Tolerance | None = None
    per_region: dict[str, Tolerance] = field(default_factory=dict)


def parse_tolerance(text: str, flag: str = "--tolerance") -> Tolerance:
    """abs:VALUE, rel:VALUE or a bare number; every way it can be wrong said in one whole line."""
    kind, _, value = text.partition(":") if ":" in text else ("abs", "", text)
    kind = kind.strip()
    if kind not in ("abs", "rel"):
        raise UserError(f"{flag} {text!r}: the kind must be abs or rel (abs:1e-3, rel:1e-2)")
    try:
        number = float(value)
    except ValueError:
        raise UserError(f"{flag} {text!r}: {value.strip()!r} is not a number (abs:1e-3, rel:1e-2)") from None
    if not math.isfinite(number) or number < 0:
        raise UserError(f"{flag} {text!r}: the bound must be a finite, non-negative number (abs:1e-3, rel:1e-2)")
    return Tolerance(kind=kind, value=number)


def check_freeze_flags(model: Path, runs_dir: Path, *, tolerance: str | None = None,
                       e2e_tolerance: str | None = None, region_tolerance: list[str] = (),
                       max_regions: int = 8, coverage: float = 0.9, freeze_problems: bool = True) -> FreezeFlags:
    """`profile` / `tune --model`'s flags, and the model file's path (not its contents)."""
    flags = FreezeFlags(tolerance=parse_tolerance(tolerance, "--tolerance") if tolerance else None,
                        e2e_tolerance=parse_tolerance(e2e_tolerance, "--e2e-tolerance") if e2e_tolerance else None)
    for item in region_tolerance:
        name, sep, text = item.partition("=")
        if not sep or not name.strip():
            raise UserError(f"--region-tolerance {item!r}: use CLASS=abs:1e-3 or CLASS=rel:1e-2")
        flags.per_region[name] = parse_tolerance(text, f"--region-tolerance {name}")
    if freeze_problems and max_regions < 1:
        raise UserError(f"--max-regions {max_regions}: freeze at least 1 region")
    if not 0 < coverage <= 1 or coverage != coverage:
        raise UserError(f"--coverage {coverage}: give a share of the model's time in (0, 1], e.g. 0.9")
    check_model_path(model)
    check_runs_dir(runs_dir)
    return flags


def model_files(given: list[Path], folder: Path | None) -> list[Path]:
    """The model files of `agent tune`: each --model, then every model file in --models DIR (its
    *.py, not a package's __init__ or a module `agent apply` wrote). A file named twice is an
    error, never a model silently dropped or tuned twice."""
    files = list(given)
    if folder is not None:
        if not folder.is_dir():
            raise UserError(f"--models {folder}: not a folder of model files")
        found = sorted(p for p in folder.glob("*.py") if not p.name.startswith("_")
                       and not p.stem.endswith("_nightshift"))
        if not found:
            raise UserError(f"--models {folder}: no model files (*.py) in it")
        files += found
    seen: set[Path] = set()
    for f in files:
        key = f.resolve()
        if key in seen:
            raise UserError(f"--model {f}: given twice; each model file once")
        seen.add(key)
    return files


def model_weights(given: list[str]) -> dict[str, float]:
    """--model-weight NAME=W, each W finite and positive."""
    out = {}
    for text in given:
        name, _, value = text.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not name.strip() or not math.isfinite(weight) or weight <= 0:
            raise UserError(f"--model-weight {text!r}: give NAME=W with W a positive number (NAME: the file's stem)")
        out[name.strip()] = weight
    return out
