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
from tools.trial import Candidate
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
    profiled = subprocess.run([sys.executable, "-m", "agent", "profile", "--model", str(CORPUS[0]), "--model",
                               str(CORPUS[1]), "--runs-dir", str(runs)], cwd=ROOT, env=ENV, capture_output=True,
                              text=True, timeout=120)  # one model: a second is never silently dropped
    assert profiled.returncode == 2 and "takes one --model" in profiled.stderr


# -- the class planner and the budget's split, without a search --------------------------------
class _Search:
    name = "template"

    def propose(self, problem, history, n):
        return [Candidate(region=problem.name, source=f"# own search of {problem.name}", planner=self.name)]


def test_the_class_planner_verifies_a_leaders_winners_then_searches_a_member_they_all_failed_on(tmp_path):
    from types import SimpleNamespace

    from agent.history import History
    from agent.planners.shared import ClassPlanner, Shared
    from tools.trial import Status, Trial
    winners = [Candidate(region="Lead", source=f"# winner {i}", planner="template", template="rmsnorm")
               for i in range(2)]
    planner = ClassPlanner(_Search(), {"Copy": Shared("a/Lead", winners=winners)}, tmp_path)
    lead, copy = SimpleNamespace(name="Lead"), SimpleNamespace(name="Copy")
    history = History({"Lead": ["cpu"], "Copy": ["cpu"]})
    assert [c.source for c in planner.propose(lead, history, 4)] == ["# own search of Lead"]
    first = planner.propose(copy, history, 4)
    assert [c.source for c in first] == ["# winner 0", "# winner 1"]
    assert all(c.region == "Copy" and c.params[CLASS_WINNER] == "a/Lead" and c.template == "rmsnorm" for c in first)

    def tried(c, status):
        history.add(Trial(region="Copy", candidate_hash=c.hash, status=status, generation="cpu",
                          speedup=1.2 if status is Status.ok else None))
    tried(first[0], Status.wrong)
    assert [c.source for c in planner.propose(copy, history, 4)] == ["# winner 1"]
    passed = History({"Copy": ["cpu"]})
    passed.records, passed.trials = dict(history.records), list(history.trials)
    tried(first[1], Status.wrong)  # every winner failed here: the member is searched on its own
    assert planner.state(copy, history)[0] == "search"
    assert [c.source for c in planner.propose(copy, history, 4)] == ["# own search of Copy"]
    passed.add(Trial(region="Copy", candidate_hash=first[1].hash, status=Status.ok, generation="cpu", speedup=1.1))
    assert planner.state(copy, passed)[0] == "shared" and planner.propose(copy, passed, 4) == []
    nothing = ClassPlanner(_Search(), {"Copy": Shared("a/Lead")}, tmp_path)  # the leader found no winner
    assert nothing.state(copy, History())[0] == "no winner" and nothing.propose(copy, History(), 4) == []


def test_the_budget_is_split_by_class_time_and_the_corpus_cap_holds(tmp_path):
    from agent.search import corpus
    from tools.corpus import ClassRecord, CorpusInfo, CorpusModel
    from tools.problem import Problem, StopRule, Tolerance, Workload

    def problem(name: str, ms: float) -> Problem:
        return Problem(name=name, region_class=name, region_path="x", region_source="", model_file="m.py",
                       model_hash="h", device="cpu", tolerance=Tolerance(value=1e-4),
                       workloads=[Workload(name="w", baseline_ms=ms)])

    class Run:  # what the split reads of a run: its problems and its store
        def __init__(self, *problems):
            self.list = list(problems)

        def problems(self):
            return self.list

        def check_store(self):
            return False

    runs = {"a": Run(problem("Norm", 1.0), problem("Attn", 6.0)), "b": Run(problem("Norm2", 1.0)),
            "c": Run(problem("Mlp", 2.0))}
    info = CorpusInfo(corpus_id="c", models=[CorpusModel(name=n, file=f"{n}.py", state="frozen") for n in "abc"])
    info.classes = [ClassRecord(key="n", members=[("a", "Norm"), ("b", "Norm2")], share=0.2),
                    ClassRecord(key="t", members=[("a", "Attn")], share=0.6),
                    ClassRecord(key="m", members=[("c", "Mlp")], share=0.2)]
    rule = StopRule(gpu_hours=1.0, max_candidates=100)
    caps = {n: corpus.model_rule(info, n, runs, rule) for n in "abc"}
    assert abs(sum(c.gpu_hours for c in caps.values()) - 1.0) < 1e-9  # the whole cap, never more
    assert abs(caps["a"].gpu_hours - 0.85 * 0.8) < 1e-9  # the leader of norms and attention, less the reserve
    assert abs(caps["b"].gpu_hours - 0.15) < 1e-9  # the only member: all of the reserve
    assert caps["b"].max_candidates == 15 + 3  # its share, plus the leader's winners to verify
    assert corpus.unique_names(["m", "n", "m"]) == ["m", "n", "m-2"]
