"""A corpus run on the CPU (agent/cli/corpus.py): several model files in one `agent tune`, a
class shared by two files searched once and its winners verified on the other member, every
model integrated or the report saying why, and kill -9 mid-run then --resume losing and redoing
no trial. Plus the budget's split and the command's refusals, which need no search."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.errors import UserError
from agent.flags import model_files, model_weights
from agent.planners.shared import CLASS_WINNER
from tools.corpus import CorpusFolder
from tools.runfolder import RunFolder

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "models"
CORPUS = [MODELS / "tiny_rmsnorm.py", MODELS / "tiny_rmsnorm_copy.py", MODELS / "tiny_mlp.py"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
CMD = [sys.executable, "-m", "agent", "tune", "--devices", "cpu", "--planner", "template", "--max-candidates", "6",
       "--patience", "50", "--json"]


def _trials(run: RunFolder) -> list:
    if not run.store_path.exists():
        return []
    store = run.store(readonly=True)
    try:
        return list(store.trials())
    except sqlite3.OperationalError:  # the file exists a moment before its tables
        return []
    finally:
        store.close()


def _kill_at_first_trial(runs: Path, log: Path) -> None:
    with open(log, "w") as out:
        proc = subprocess.Popen(CMD + [a for m in CORPUS for a in ("--model", str(m))] + ["--runs-dir", str(runs)],
                                cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if any(_trials(RunFolder(db.parent)) for db in runs.glob("*/models/*/trials.sqlite")):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the corpus finished before it could be killed:\n" + log.read_text()[-3000:]
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_corpus_searches_a_shared_class_once_integrates_every_model_and_resumes_after_kill_9(tmp_path):
    runs = tmp_path / "runs"
    _kill_at_first_trial(runs, tmp_path / "first.log")
    (path,) = runs.glob("corpus-*")
    folder = CorpusFolder.open(path)
    before = {name: _trials(run) for name, run in folder.runs().items()}
    assert sum(map(len, before.values())) >= 1

    resumed = subprocess.run(CMD + ["--resume", str(path)], cwd=ROOT, env=ENV, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout)
    info = folder.info()
    assert [m.state for m in info.models] == ["done"] * 3

    # The copied norm is one class with the original, led by the file that came first; the MLP is alone.
    classes = {tuple(f"{m}/{r}" for m, r in c.members) for c in info.classes}
    assert classes == {("tiny_rmsnorm/RMSNorm", "tiny_rmsnorm_copy/CopiedNorm"), ("tiny_mlp/Model",)}

    runs_by_model = folder.runs()
    after = {name: _trials(run) for name, run in runs_by_model.items()}
    for name, trials in after.items():  # nothing lost, nothing run twice
        keys = [(t.region, t.candidate_hash, t.generation) for t in trials]
        assert len(keys) == len(set(keys)), name
        assert [t.model_dump() for t in trials[: len(before[name])]] == [t.model_dump() for t in before[name]]

    # No class searched twice: the copy ran only the leader's winners, each verified on its own problem.
    leader = {t.candidate_hash for t in after["tiny_rmsnorm"] if t.status.value == "ok"}
    copy = after["tiny_rmsnorm_copy"]
    assert copy and all(t.params.get(CLASS_WINNER) == "tiny_rmsnorm/RMSNorm" for t in copy)
    assert {t.candidate_hash for t in copy} <= leader
    assert any(t.status.value == "ok" for t in copy)

    # Every model integrated, or the report says why not.
    report = (path / "report.md").read_text()
    for m in info.models:
        run = runs_by_model[m.name]
        row = next(line for line in report.splitlines() if line.startswith(f"| {m.name} |"))
        assert (run.path / "integration.json").is_file() or row.rstrip(" |").split("|")[-1].strip() not in ("", "-")
    assert "| tiny_rmsnorm_copy/CopiedNorm | winner passed here" in report
    assert [m["state"] for m in summary["models"]] == ["done"] * 3

    status = subprocess.run([sys.executable, "-m", "agent", "status", str(path), "--json"], cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=120)
    assert status.returncode == 0 and not json.loads(status.stdout)["running"]
    applied = subprocess.run([sys.executable, "-m", "agent", "apply", str(path)], cwd=ROOT, env=ENV,
                             capture_output=True, text=True, timeout=120)
    assert applied.returncode == 2 and "is a corpus: apply each model's run" in applied.stderr


def test_model_files_refuse_a_file_twice_an_empty_folder_and_bad_weights(tmp_path):
    with pytest.raises(UserError, match="given twice"):
        model_files([CORPUS[0], CORPUS[0]], None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no model files"):
        model_files([], tmp_path / "empty")
    (tmp_path / "zoo").mkdir()
    for name in ("b.py", "a.py", "__init__.py", "a_nightshift.py"):
        (tmp_path / "zoo" / name).write_text("")
    assert [p.name for p in model_files([], tmp_path / "zoo")] == ["a.py", "b.py"]
    assert model_weights(["a=2", "b=0.5"]) == {"a": 2.0, "b": 0.5}
    for bad in ("a", "a=0", "a=-1", "=2", "a=nan"):
        with pytest.raises(UserError, match="--model-weight"):
            model_weights([bad])


def test_a_corpus_with_a_missing_file_or_an_unknown_weight_is_refused_before_anything_is_made(tmp_path):
    runs = tmp_path / "runs"
    for extra, said in ((["--model", str(tmp_path / "gone.py")], "gone.py"),
                        (["--model-weight", "nobody=2"], "no model named nobody")):
        done = subprocess.run(CMD + ["--model", str(CORPUS[0]), "--model", str(CORPUS[1]), *extra,
                                     "--runs-dir", str(runs)], cwd=ROOT, env=ENV, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2 and said in done.stderr, done.stderr
        assert not runs.exists() or not any(runs.iterdir())
