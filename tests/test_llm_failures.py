"""An LLM API that misbehaves, through the real SDK clients and a local replay server: bodies
that are not completions, answers that cannot be read, a bad key, a run of server errors. The
tuner never crashes; it asks again where asking again can help, says on stderr and in the
report why a planner stopped (in the provider's words), and exits non-zero when no planner
could propose anything."""

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.replay_server import ReplayServer, answer, error, raw

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "models" / "tiny_rmsnorm.py"
MODEL = {"anthropic": "claude-sonnet-4-5", "openai": "gpt-4o"}
GOOD = '''import torch

def forward(module, x):
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + module.eps)
    return module.weight * y.to(x.dtype)
'''
PROVIDERS = ["anthropic", "openai"]


def reply(*sources: str) -> str:
    return json.dumps({"candidates": [{"note": f"idea {i}", "source": s} for i, s in enumerate(sources)]})


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("llm-failures")
    result = subprocess.run([sys.executable, "-m", "agent", "profile", "--model", str(TINY), "--runs-dir", str(runs),
                             "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    return Path(json.loads(result.stdout)["run"])


def tune(run: Path, provider: str, server: ReplayServer, planner: str | None = None, *extra):
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    env.update({"PYTHONPATH": str(ROOT), f"{provider.upper()}_API_KEY": "sk-test-not-real-0000",
                # Retries as the product makes them, with waits of milliseconds, not seconds.
                "NIGHTSHIFT_LLM_BACKOFF": "0.01,0.05"})
    base = server.url if provider == "anthropic" else server.url + "/v1"
    return subprocess.run([sys.executable, "-m", "agent", "tune", "--resume", str(run), "--planner", planner or provider,
                           "--base-url", base, "--llm-model", MODEL[provider], "--devices", "cpu", "--no-integrate",
                           "--json", *map(str, extra)], capture_output=True, text=True, env=env, cwd=run.parent,
                          timeout=600)


@pytest.fixture
def run(profiled, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(profiled, dst)
    return dst


def statuses(run: Path) -> list[str]:
    db = sqlite3.connect(run / "trials.sqlite")
    return [s for (s,) in db.execute("SELECT status FROM trials ORDER BY id")]


def no_traceback(proc: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_200_that_is_not_a_completion_is_retried_not_a_crash(run, provider):
    script = [raw('{"id": "msg_01", "content": [{"type": "te'), raw("<html><body>502 Bad Gateway</body></html>",
                                                                      content_type="text/html"),
              answer(reply(GOOD)), answer(reply()), answer(reply())]
    with ReplayServer(script) as server:
        proc = tune(run, provider, server)
    no_traceback(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Asked ahead while the one candidate runs (nothing), then once more with its result (nothing).
    assert statuses(run) == ["ok"] and len(server.requests) == 5
    assert "not a completion" in proc.stderr and "not JSON ('<html><body>502 Bad Gateway</body></html>')" in proc.stderr


@pytest.mark.parametrize("provider", PROVIDERS)
def test_an_unreadable_answer_is_recorded_and_asked_again(run, provider):
    script = [answer("Happy to help! The key idea is to fuse the reduction."), answer(None), answer(reply(GOOD)),
              answer(reply()), answer(reply())]  # asked ahead while GOOD runs, then with its result
    with ReplayServer(script) as server:
        proc = tune(run, provider, server)
    no_traceback(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert statuses(run) == ["ok"]
    second, third = (json.dumps(r.body) for r in server.requests[1:3])
    assert "could not be read" in second and "fuse the reduction" in second  # the model sees what it said
    assert "could not be read" in third
    db = sqlite3.connect(run / "trials.sqlite")
    raws = [json.loads(b)["raw"] for (b,) in db.execute("SELECT body FROM events WHERE kind = 'malformed_answer'")]
    assert raws == ["Happy to help! The key idea is to fuse the reduction.", ""]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_unreadable_answers_stop_the_planner_after_a_bound(run, provider):
    from agent.planners.llm import MAX_ASKS
    with ReplayServer([answer("I'd rather explain it in words.")] * (MAX_ASKS + 3)) as server:
        proc = tune(run, provider, server)
    no_traceback(proc)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert len(server.requests) == MAX_ASKS
    why = f"{provider} planner stopped: {MAX_ASKS} answers in a row for RMSNorm could not be read"
    assert f"error: {why}" in proc.stderr
    assert json.loads(proc.stdout)["planner_failure"].startswith(why)
    assert why in (run / "report.md").read_text()


@pytest.mark.parametrize("provider, script, words, requests", [
    ("anthropic", [error(401, "invalid x-api-key")], "HTTP 401: invalid x-api-key", 1),
    ("openai", [error(401, "Incorrect API key provided: sk-test-****0000")], "HTTP 401: Incorrect API key", 1),
    ("anthropic", [error(529, "Overloaded", headers={"retry-after": "0"})] * 5,
     "HTTP 529: Overloaded; gave up after 5 attempts", 5),
    ("openai", [error(503, "The server is overloaded", headers={"retry-after": "0"})] * 5,
     "HTTP 503: The server is overloaded; gave up after 5 attempts", 5),
], ids=["anthropic-401", "openai-401", "anthropic-529-run", "openai-503-run"])
def test_api_failures_stop_the_planner_and_say_why(run, provider, script, words, requests):
    with ReplayServer(script) as server:
        proc = tune(run, provider, server)
    no_traceback(proc)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert len(server.requests) == requests
    assert words in proc.stderr and "planner stopped" in proc.stderr
    summary = json.loads(proc.stdout)
    assert words in summary["planner_failure"] and summary["trials"] == 0
    report = (run / "report.md").read_text()
    assert "Planner stopped" in report and words in report
    assert "sk-test-not-real" not in proc.stderr + report


def test_one_failed_planner_does_not_end_the_others_night(run):
    with ReplayServer([error(401, "invalid x-api-key")]) as server:
        proc = tune(run, "anthropic", server, "template,anthropic", "--max-candidates", 2)
    no_traceback(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["trials"] == 2 and summary["stop_reason"].startswith("candidate cap")
    assert "note: anthropic planner stopped: anthropic claude-sonnet-4-5: HTTP 401" in proc.stderr
    assert "HTTP 401: invalid x-api-key" in (run / "report.md").read_text()


def test_sigterm_while_the_llm_is_thinking_stops_at_once(run):
    """A stop never waits for an API call that may take minutes (a slow or hung server)."""
    import signal
    import time
    from tests.replay_server import delay
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    env.update({"PYTHONPATH": str(ROOT), "ANTHROPIC_API_KEY": "sk-test-not-real-0000"})
    with ReplayServer([delay(60)]) as server:
        proc = subprocess.Popen([sys.executable, "-m", "agent", "tune", "--resume", str(run), "--planner", "anthropic",
                                 "--base-url", server.url, "--llm-model", MODEL["anthropic"], "--devices", "cpu",
                                 "--no-integrate"], cwd=run.parent, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while not server.requests and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.1)
            assert server.requests, "the planner never asked"
            time.sleep(0.5)
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=30)
            took = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    assert took < 20, f"the stop waited {took:.0f} s for the LLM call"
    assert "stopped: interrupted (SIGTERM)" in out and "Traceback" not in err
