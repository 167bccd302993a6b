"""Every JSON document the tool writes parses with a strict parser (JavaScript's JSON.parse, jq,
Go's encoding/json refuse a bare NaN or Infinity), and a non-finite number in one reads back as
the number: a degenerate model whose every output is NaN, and a candidate whose error is infinite,
through the commands a user runs."""

import json
import math
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ALL_NAN = ROOT / "tests" / "models" / "all_nan.py"
NANS = 'import torch\n\ndef forward(module, x):\n    return torch.full((x.shape[0], 8), float("nan"))\n'
INFS = NANS.replace('float("nan")', 'float("inf")')


def agent(*args, codes=(0,)) -> str:
    got = subprocess.run([sys.executable, "-m", "agent", *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert got.returncode in codes and "Traceback" not in got.stderr, (got.returncode, got.stderr[-3000:])
    return got.stdout


def strict(text: str):
    return json.loads(text, parse_constant=lambda word: pytest.fail(f"not strict JSON: bare {word}"))


def test_every_json_of_a_run_is_strict_and_a_non_finite_number_reads_back(tmp_path):
    from tools.problem import Problem
    from tools.runfolder import RunFolder

    profiled = strict(agent("profile", "--model", ALL_NAN, "--runs-dir", tmp_path, "--json"))
    run = Path(profiled["run"])
    (name,) = profiled["problems"]
    assert strict((run / "problems" / name / "problem.json").read_text())["constant_output"] == "NaN"
    assert math.isnan(Problem.load(run / "problems" / name).constant_output)

    (run / "inbox" / name).mkdir(parents=True)
    (run / "inbox" / name / "nans.py").write_text(NANS)
    tuned = strict(agent("tune", "--resume", run, "--planner", "files", "--max-candidates", 1, "--json"))
    assert tuned["trials"] == 1 and not isinstance(tuned["integration"], str), tuned
    (tmp_path / "infs.py").write_text(INFS)
    tried = strict(agent("try", run, tmp_path / "infs.py", "--json", codes=(1,)))
    assert tried["status"] == "wrong" and tried["max_abs"] == "Infinity"
    strict(agent("status", run, "--json"))

    files = {p.relative_to(run).as_posix(): p for p in run.rglob("*.json")}
    assert {"run.json", "hotspots.json", "trace.json", "seal.json", "integration.json", "model/problem.json",
            f"problems/{name}/problem.json"} <= set(files)
    for path in files.values():
        strict(path.read_text())
    db = sqlite3.connect(run / "trials.sqlite")
    try:
        for (body,) in db.execute("SELECT body FROM trials UNION ALL SELECT body FROM events"):
            strict(body)
    finally:
        db.close()
    store = RunFolder.open(run).store(readonly=True)
    try:
        (back,) = [t for t in store.trials() if t.candidate_hash == tried["candidate_hash"]]
    finally:
        store.close()
    assert back.max_abs == math.inf  # pydantic wrote null for it: read back, the error was gone
