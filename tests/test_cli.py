"""The command line as a user (or a coding agent) meets it: every command through a real
subprocess, its exit code, its JSON, and one clear line (never a traceback) for bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "models" / "tiny_rmsnorm.py"
CANDIDATES = ROOT / "tests" / "candidates"


def agent(*args, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "LLAMA_PRESET": "small", **(env or {})}
    return subprocess.run([sys.executable, "-m", "agent", *map(str, args)], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def ok_json(result: subprocess.CompletedProcess, codes=(0,)):
    assert result.returncode in codes, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return strict(result.stdout)


def strict(text: str):
    """As a strict parser reads JSON (JavaScript's, jq's, Go's): a bare NaN or Infinity is an error."""
    return json.loads(text, parse_constant=lambda word: pytest.fail(f"not strict JSON: bare {word}"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cli-runs")


@pytest.fixture(scope="module")
def tiny_run(runs) -> Path:
    """`agent profile` of a model whose hot region is an RMSNorm: one problem, RMSNorm."""
    data = ok_json(agent("profile", "--model", TINY, "--runs-dir", runs / "profiled", "--json"))
    assert data["problems"] == ["RMSNorm"]
    return Path(data["run"])


@pytest.fixture(scope="module")
def tuned(runs) -> dict:
    return ok_json(agent("tune", "--model", TINY, "--runs-dir", runs / "tuned", "--max-candidates", 3,
                         "--devices", "cpu", "--json"))


def test_doctor_json_never_prints_api_keys():
    result = agent("doctor", "--json", env={"ANTHROPIC_API_KEY": "sk-test-SECRET"})
    report = ok_json(result, codes=(0, 1))
    assert (result.returncode == 0) == report["ok"]
    assert report["api_keys"]["ANTHROPIC_API_KEY"] == "set"
    assert "SECRET" not in result.stdout and "SECRET" not in result.stderr


def test_profile_writes_a_self_describing_run_folder(runs):
    data = ok_json(agent("profile", "--model", ROOT / "examples" / "llama.py", "--runs-dir", runs / "llama",
                         "--json"))
    run = Path(data["run"])
    assert run.parent == runs / "llama"
    for name in ("run.json", "hotspots.json", "trace.json"):
        json.loads((run / name).read_text())
    assert data["problems"], data["skipped"]
    for name in data["problems"]:
        problem = json.loads((run / "problems" / name / "problem.json").read_text())
        assert problem["name"] == name and problem["workloads"]
    assert data["hotspots"]["device"] == "cpu"


def test_try_a_correct_candidate_exits_0(tiny_run):
    result = agent("try", tiny_run, CANDIDATES / "rmsnorm_triton.py", "--region", "RMSNorm", "--json")
    trial = ok_json(result)
    assert trial["status"] == "ok" and trial["error"] <= 1e-4 and trial["speedup"] > 0
    assert all(t["timing_kind"] == "cpu" for t in trial["timings"])
    # The verdict is kept in the run, and the candidate's source next to it.
    assert Path(trial["candidate_path"]).parent == tiny_run / "candidates"


def test_try_a_wrong_candidate_exits_1(tiny_run):
    # A problem folder works as well as a run folder plus --region.
    result = agent("try", tiny_run / "problems" / "RMSNorm", CANDIDATES / "adversarial" / "wrong_math.py")
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.startswith("wrong:") and "Traceback" not in result.stderr


def test_try_prints_the_candidates_exception_as_text(tiny_run, tmp_path):
    candidate = tmp_path / "raises.py"
    candidate.write_text("def forward(module, x):\n    raise RuntimeError('[/oops] [red]not markup')\n")
    result = agent("try", tiny_run, candidate)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stdout.splitlines()[0] == "runtime_error: RuntimeError: [/oops] [red]not markup"


def test_tune_status_and_report(tuned):
    assert tuned["stop_reason"] == "candidate cap: 3 candidates tried" and tuned["trials"] == 3
    assert tuned["timing_kind"] == "cpu" and tuned["best_speedup"]["RMSNorm"] > 0
    run = Path(tuned["run"])
    assert Path(tuned["report"]) == run / "report.md" and (run / "report.md").is_file()

    status = ok_json(agent("status", run, "--json"))
    (row,) = status["regions"]
    assert row["region"] == "RMSNorm" and row["trials"] == 3 and row["kept"] >= 1
    assert row["best_template"] == "rmsnorm" and row["best_error"] <= 1e-4
    assert status["gpu_seconds"] == pytest.approx(tuned["gpu_seconds"])

    (run / "report.md").unlink()
    result = agent("report", run)
    assert result.returncode == 0 and "report.md" in result.stdout
    assert "| RMSNorm | 100% | 3 |" in (run / "report.md").read_text()


def test_tune_on_two_simulated_generations_reports_cpu_timings_for_both(runs):
    summary = ok_json(agent("tune", "--model", TINY, "--runs-dir", runs / "two-gens", "--devices", "cpu@a,cpu@b",
                            "--max-candidates", 2, "--json"))
    assert summary["timing_kind"] == "cpu"  # labels are generations; the timings are still CPU timings
    assert summary["trials"] == 4  # two candidates, each on both generations
    (row,) = ok_json(agent("status", summary["run"], "--json"))["regions"]
    assert set(row["best_by_generation"]) == {"a", "b"}
    assert row["best_speedup"] == pytest.approx(min(row["best_by_generation"].values()))


# -- bad input: exit 2, one line naming the problem, no traceback ---------------------------
BAD = {
    "missing model file": (["profile", "--model", "tests/models/no_such_model.py"], "no_such_model.py"),
    # Brackets in a path are text: neither dropped nor a crash of the console's markup.
    "bracketed path": (["profile", "--model", "gone/[old]/[/x].py"], "gone/[old]/[/x].py: model file not found"),
    "tune, missing model file": (["tune", "--model", "tests/models/no_such_model.py", "--json"], "no_such_model.py"),
    "syntax error in model": (["profile", "--model", "tests/models/bad_syntax.py"], "syntax error at line 6"),
    "sys.exit in a model file": (["tune", "--model", "tests/models/bad_sys_exit.py"], "called sys.exit(3)"),
    "sys.exit in get_inputs": (["profile", "--model", "tests/models/bad_sys_exit_in_inputs.py"],
                               "called sys.exit('no inputs here')"),
    "gpu-hours nan": (["tune", "--model", TINY, "--gpu-hours", "nan"], "--gpu-hours must be a finite"),
    "gpu-hours negative": (["tune", "--model", TINY, "--gpu-hours", "-1"], "--gpu-hours"),
    "gpu-hours zero": (["tune", "--model", TINY, "--gpu-hours", "0"], "--gpu-hours 0: no trial fits"),
    "max-candidates zero": (["tune", "--model", TINY, "--max-candidates", "0"], "--max-candidates 0: nothing"),
    "max-candidates negative": (["tune", "--model", TINY, "--max-candidates", "-2"], "--max-candidates -2: nothing would be tried"),
    "patience negative": (["tune", "--model", TINY, "--patience", "-3"], "--patience"),
    "patience zero": (["tune", "--model", TINY, "--patience", "0"], "--patience 0"),
    "max-usd zero": (["tune", "--model", TINY, "--max-usd", "0"], "--max-usd 0"),
    "workers-per-gpu negative": (["tune", "--model", TINY, "--workers-per-gpu", "-1"], "--workers-per-gpu"),
    "max-regions negative": (["tune", "--model", TINY, "--max-regions", "-1"], "--max-regions -1"),
    "profile max-regions zero": (["profile", "--model", TINY, "--max-regions", "0"], "--max-regions 0"),
    "coverage outside (0, 1]": (["profile", "--model", TINY, "--coverage", "2"], "--coverage 2"),
    # The whole message, not pydantic's first line.
    "tolerance nan": (["tune", "--model", TINY, "--tolerance", "abs:nan"],
                      "--tolerance 'abs:nan': the bound must be a finite, non-negative number (abs:1e-3, rel:1e-2)"),
    "tolerance kind": (["profile", "--model", TINY, "--tolerance", "max:1"], "the kind must be abs or rel"),
    "tolerance not a number": (["profile", "--model", TINY, "--tolerance", "abs:tiny"], "'tiny' is not a number"),
    "region-tolerance without a class": (["profile", "--model", TINY, "--region-tolerance", "abs:1"],
                                         "--region-tolerance"),
    "unknown region": (["tune", "--model", TINY, "--regions", "Nope"], "--regions: no module class Nope"),
    "region-tolerance for an unknown class": (["profile", "--model", TINY, "--region-tolerance", "Nope=abs:1"],
                                              "--region-tolerance: no module class Nope"),
    "no device": (["tune", "--model", TINY, "--devices", ","], "--devices ',': no device given"),
    "malformed device": (["tune", "--model", TINY, "--devices", "cuda:abc"], "--devices 'cuda:abc'"),
    "planner twice": (["tune", "--model", TINY, "--planner", "template,template"], "names a planner twice"),
    "unknown executor": (["tune", "--model", TINY, "--executor", "slurm"], "--executor 'slurm'"),
    "unknown compile mode": (["tune", "--model", TINY, "--compile-modes", "torch.compile,max-autotune"],
                             "--compile-modes 'torch.compile,max-autotune': name one or more of"),
    "no compile mode": (["tune", "--model", TINY, "--compile-modes", ","], "--compile-modes ','"),
    "neither model nor resume": (["tune"], "--model"),
    "both model and resume": (["tune", "--model", TINY, "--resume", "runs/x"], "--model"),
    "profile on cuda": (["profile", "--model", TINY, "--device", "cuda"], "CUDA"),
    "runs-dir on a read-only file system": (["profile", "--model", TINY, "--runs-dir", "/proc/nightshift-runs"],
                                            "--runs-dir /proc/nightshift-runs: cannot create folders"),
    # Parse errors: one line too, never a usage box.
    "unknown option": (["tune", "--max-candidatez", "3"], "No such option: --max-candidatez"),
    "not an integer": (["tune", "--model", TINY, "--max-candidates", "many"], "Invalid value for '--max-candidates'"),
    "missing option value": (["apply", "runs/x", "--region"], "requires an argument"),
    "unknown command": (["tunes"], "No such command 'tunes'"),
    "missing argument": (["try"], "Missing argument"),
}
BAD_ON_RUN = {
    "unknown planner": (["tune", "--resume", "{run}", "--planner", "nope", "--json"], "nope"),
    "tune on cuda devices": (["tune", "--resume", "{run}", "--devices", "cuda:0", "--json"], "CUDA"),
    "try on a non-run folder": (["try", "{runs}", CANDIDATES / "rmsnorm_triton.py"], "neither a run folder"),
    "try, unknown region": (["try", "{run}", CANDIDATES / "rmsnorm_triton.py", "--region", "Nope"], "Nope"),
    "try, missing candidate": (["try", "{run}", "{runs}/nope.py"], "nope.py: candidate file not found"),
    "integrate, unknown compile mode": (["integrate", "{run}", "--compile-modes", "default"],
                                        "--compile-modes 'default'"),
    "status of a non-run folder": (["status", "{runs}"], "not a run folder"),
    "resume a non-run folder": (["tune", "--resume", "{runs}"], "not a run folder"),
    "runs-dir is a file": (["tune", "--model", TINY, "--runs-dir", "{run}/run.json"], "is a file, not a directory"),
}


def assert_one_line_error(result: subprocess.CompletedProcess, words: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, result.stderr
    assert "Usage:" not in result.stderr and "╭" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], result.stderr


@pytest.mark.parametrize("args, words", BAD.values(), ids=BAD.keys())
def test_bad_input_exits_2_with_one_line(args, words, tmp_path):
    extra = ["--runs-dir", tmp_path] if (args[0] == "profile" or "--model" in args) and "--runs-dir" not in args \
        else []
    result = agent(*args, *extra)
    assert_one_line_error(result, words)
    assert not list(tmp_path.iterdir()), "a bad input left a run folder behind"


@pytest.mark.parametrize("args, words", BAD_ON_RUN.values(), ids=BAD_ON_RUN.keys())
def test_bad_input_on_a_run_exits_2_with_one_line(args, words, tiny_run, tmp_path):
    args = [str(a).replace("{run}", str(tiny_run)).replace("{runs}", str(tmp_path)) for a in args]
    before = _tree(tiny_run)
    assert_one_line_error(agent(*args), words)
    assert _tree(tiny_run) == before, "a bad input changed the run"


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file's bytes, but SQLite's own -wal/-shm files (a reader of a WAL store makes them)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.endswith(("-wal", "-shm"))}


@pytest.mark.parametrize("command", ["status", "report", "tune --resume", "try", "apply", "integrate"])
def test_a_garbage_run_json_is_named(command, tiny_run, tmp_path):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    (run / "run.json").write_text('{"run_id": "x", "model_file": 3')
    before = _tree(run)
    args = command.split() + [run] + ([CANDIDATES / "rmsnorm_triton.py"] if command == "try" else [])
    result = agent(*args)
    assert_one_line_error(result, f"{run / 'run.json'} is not a valid run description")
    assert _tree(run) == before


def test_a_garbage_integration_json_is_named_by_apply(tiny_run, tmp_path):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    (run / "integration.json").write_text("[1, 2")
    assert_one_line_error(agent("apply", run), f"{run / 'integration.json'} cannot be read")


SCALAR_OUT = """import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(32)

    def forward(self, x):
        return self.norm(x), float(x.shape[-1])  # a number beside the tensor: no end-to-end reference


def get_init_inputs():
    return []


def get_inputs():
    return [torch.randn(8, 32)]
"""


def test_a_run_that_cannot_be_integrated_says_why_and_the_report_repeats_it(tmp_path):
    """A model whose output holds a Python number freezes its regions but no whole-model problem:
    integration says that (not 'no problem.json ... profile again', which cannot help), and the
    report gives the same reason instead of 'has not run yet'."""
    model = tmp_path / "scalar_out.py"
    model.write_text(SCALAR_OUT)
    run = ok_json(agent("profile", "--model", model, "--runs-dir", tmp_path / "runs", "--json"))["run"]
    result = agent("integrate", run)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "returns something other than tensors" in result.stderr and "profile" not in result.stderr, result.stderr
    report = agent("report", run)
    assert report.returncode == 0, report.stderr[-2000:]
    text = report.stdout + "".join(p.read_text() for p in Path(run).glob("report*.md"))
    assert "Integration gave no result" in text and "returns something other than tensors" in text, text[-2000:]
    assert "has not run yet" not in text


def test_json_on_stdout_stays_json_when_the_model_prints(tmp_path):
    """A model that prints in every forward (and while it is built): with --json, stdout is the
    JSON document alone; what the model printed goes to stderr."""
    model = tmp_path / "chatty.py"
    model.write_text(SCALAR_OUT.replace("return self.norm(x), float(x.shape[-1])", "print('forward!'); return self.norm(x)")
                     .replace("self.norm = nn.LayerNorm(32)", "self.norm = nn.LayerNorm(32)\n        print('built!')"))
    result = agent("profile", "--model", model, "--runs-dir", tmp_path / "runs", "--json")
    data = ok_json(result)
    assert data["problems"] and "forward!" in result.stderr and "built!" in result.stderr


@pytest.mark.parametrize("entry", ["python -m agent", "console script"])
def test_a_daemon_thread_inside_torch_at_exit_does_not_abort_the_command(tmp_path, entry):
    """Python 3.11 unwinds daemon threads at exit, and one inside torch's C++ code aborts the
    process after the command's work was done: CI saw a tune print its JSON, then die of SIGABRT
    while a planner call was still running. The command's own exit code comes back, every time,
    also from the `agent` script pip installs (it called agent.cli.main, past the guard)."""
    import tomllib
    module, _, func = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["agent"].partition(":")
    marker = tmp_path / "exit-handler-ran"
    code = ("import atexit, runpy, sys, threading, torch\n"
            "torch.set_num_threads(1)  # busy inside torch on one core, not on every core of the machine\n"
            "x = torch.randn(600, 600)\n"
            "def busy():\n"
            "    while True:\n"
            "        x @ x\n"
            "threading.Thread(target=busy, daemon=True, name='nightshift-planner').start()\n"
            f"atexit.register(lambda: open({str(marker)!r}, 'w').close())\n"
            f"sys.argv = ['agent', 'skill', 'install', '--project', {str(tmp_path)!r}, '--json']\n"
            + ("runpy.run_module('agent', run_name='__main__')\n" if entry == "python -m agent" else
               f"from {module} import {func}\nsys.exit({func}())\n"))  # what pip's script does
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # One run: the plain interpreter exit aborts there every time (3 of 3 on torch 2.13, CPU).
    got = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0 and "terminate called" not in got.stderr, (got.returncode, got.stderr[-2000:])
    assert json.loads(got.stdout)["written"] and marker.exists()  # its output whole, the exit handlers run


FLAGGED = """import ctypes, runpy
import agent.cli.main as cli

def command():
    # A SIGTERM landing in code that C ran as a string (exec of a dataclass's __init__ during an
    # import, say), caught by the command: CPython flags it as unhandled all the same.
    run = ctypes.pythonapi.PyRun_String
    run.restype, run.argtypes = ctypes.py_object, [ctypes.c_char_p, ctypes.c_int, ctypes.py_object, ctypes.py_object]
    try:
        run(b"raise KeyboardInterrupt('SIGTERM')", 257, {}, {})
    except KeyboardInterrupt:
        raise SystemExit(3)

cli.main = command  # what agent/__main__.py calls
runpy.run_module("agent", run_name="__main__")
"""


def test_an_interrupt_a_command_caught_inside_c_code_does_not_become_the_exit(tmp_path):
    """The SIGTERM-while-profiling test died of SIGINT (exit -2) 2 times in 40 after printing its
    clean message: the interrupt had been raised inside a string C code ran, which sets CPython's
    flag for an unhandled one, and the interpreter killed itself by SIGINT after finalizing. The
    command's own exit code comes back (run with -m, as `agent` runs)."""
    (tmp_path / "flagged.py").write_text(FLAGGED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    got = subprocess.run([sys.executable, "-m", "flagged"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert got.returncode == 3, (got.returncode, got.stderr[-2000:])


def test_an_interrupt_ends_the_command_even_with_a_thread_nothing_will_end(tmp_path):
    """A SIGTERM that cut a thread pool's submit short left a thread that nothing ever ends (started,
    never registered for the pool's shutdown); the interpreter's exit waited for it forever (1 in
    12 runs of the SIGTERM-while-profiling test under load). After an interrupt the command ends
    with 130 once its exit handlers have run."""
    marker = tmp_path / "exit-handler-ran"
    code = ("import atexit, runpy, threading\n"
            "import agent.cli.main as cli\n"
            "threading.Thread(target=threading.Event().wait, name='orphan').start()\n"
            f"atexit.register(lambda: open({str(marker)!r}, 'w').close())\n"
            "def interrupted():\n"
            "    raise KeyboardInterrupt('SIGTERM')\n"
            "cli.main = interrupted\n"
            "runpy.run_module('agent', run_name='__main__')\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NIGHTSHIFT_EXIT_AFTER_INTERRUPT_S": "2"}
    got = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert got.returncode == 130 and marker.exists(), (got.returncode, got.stderr[-2000:])
