"""The adversarial suite: each cheating or broken candidate is rejected with the right status,
the harness keeps running, and correct candidates pass."""

import re
import socket
import threading
from pathlib import Path

import pytest

from sandbox.runner import Limits, TrialRunner
from sandbox.client import WorkerConfig
from tools.trial import Candidate, Status

HERE = Path(__file__).parent
ADVERSARIAL = sorted((HERE / "candidates" / "adversarial").glob("*.py"))


def expected(path: Path) -> str:
    return re.search(r"EXPECT: (\w+)", path.read_text()).group(1)


@pytest.fixture(scope="module")
def runner(frozen_run, monkeypatch_module):
    # A secret in the tuner's environment must never reach candidate code.
    monkeypatch_module.setenv("ANTHROPIC_API_KEY", "sk-ant-test-not-a-real-key")
    r = TrialRunner("cpu", Limits(compile_s=30, run_s=8, time_s=60, budget_ms=50, max_reps=20),
                    WorkerConfig(device="cpu", memory_gb=6))
    r.add_problem(frozen_run / "LlamaRMSNorm")
    yield r
    r.close()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def closed_port():
    """A listening loopback server, to see whether a worker can reach it."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    stop = threading.Event()

    def serve():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                srv.accept()[0].close()
            except OSError:
                pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    srv.close()


@pytest.mark.parametrize("path", ADVERSARIAL, ids=[p.stem for p in ADVERSARIAL])
def test_adversarial_candidate_gets_its_status(path, runner, frozen_run, closed_port):
    source = path.read_text().replace("{reference_path}", str(frozen_run / "LlamaRMSNorm" / "reference.pt"))
    source = source.replace("{port}", str(closed_port))
    trial = runner.run(Candidate(region="LlamaRMSNorm", source=source), do_time=False)
    assert trial.status.value == expected(path), (trial.status, trial.reason, trial.error_text[-800:])
    assert trial.status is Status.ok or not trial.ranked
    if path.stem == "reads_api_key":
        assert "KeyError" in trial.error_text and "sk-ant" not in trial.error_text


def test_harness_survives_crashes_and_still_verifies_and_times(runner):
    crash = Candidate(region="LlamaRMSNorm", source="import os\ndef forward(m, x):\n    os._exit(1)\n")
    assert runner.run(crash).status is Status.crash
    good = (HERE / "candidates" / "rmsnorm_triton.py").read_text()
    trial = runner.run(Candidate(region="LlamaRMSNorm", source=good))
    assert trial.status is Status.ok, trial.reason
    assert trial.error is not None and trial.error <= 1e-4
    assert trial.fresh_error is not None and trial.fresh_error <= 1e-4
    assert {t.workload for t in trial.timings} == {"prefill", "decode", "small_batch"}
    assert all(t.timing_kind == "cpu" and t.baseline_ms > 0 and t.candidate_ms > 0 for t in trial.timings)
    assert trial.speedup is not None and trial.ranked


def test_worker_environment_is_scrubbed():
    from sandbox.isolation import worker_env
    env = worker_env({"PATH": "/bin", "OPENAI_API_KEY": "x", "TRITON_CACHE_DIR": "/c", "AWS_SECRET_ACCESS_KEY": "y",
                      "TORCH_AUTH_TOKEN": "z", "HF_TOKEN": "t"}, "/tmp/w", None)
    assert env["PATH"] == "/bin" and env["TRITON_CACHE_DIR"] == "/c" and env["HOME"] == "/tmp/w"
    assert not {"OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY", "TORCH_AUTH_TOKEN", "HF_TOKEN"} & set(env)
    assert env["CUDA_VISIBLE_DEVICES"] == ""
