"""`agent tune --planner anthropic|openai` end to end on the CPU, through the real SDK
clients talking to a local server that replays recorded answers in each provider's format."""

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.replay_server import ReplayServer, answer

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "models" / "tiny_rmsnorm.py"

GOOD = '''import torch

def forward(module, x):
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + module.eps)
    return module.weight * y.to(x.dtype)
'''
WRONG = GOOD.replace("+ module.eps", "+ 0.5")
# Behaves only if the tuner's API key did not reach it: a leaked key makes its output wrong.
KEY_PROBE = GOOD.replace("import torch", "import os\nimport torch").replace(
    "    return module.weight", "    if any('KEY' in k for k in os.environ):\n        y = y * 2\n    return module.weight")
TUNABLE = GOOD.replace("x32.pow(2).mean(-1, keepdim=True)", "(x32 * x32).sum(-1, keepdim=True) / x.shape[-1]") + \
    "\nCHUNK = {{ CHUNK }}\n"


def reply(*candidates) -> str:
    return json.dumps({"candidates": [{"note": n, "source": s, **({"tunables": t} if t else {})}
                                      for n, s, t in candidates]})


def tune(tmp_path, provider, server, *extra):
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    env.update({"PYTHONPATH": str(ROOT), f"{provider.upper()}_API_KEY": "sk-test-not-real-0000",
                # Retries as the product makes them, with waits of milliseconds, not seconds.
                "NIGHTSHIFT_LLM_BACKOFF": "0.01,0.05"})
    base = server.url if provider == "anthropic" else server.url + "/v1"
    return subprocess.run([sys.executable, "-m", "agent", "tune", "--model", str(TINY), "--planner", provider,
                           "--base-url", base, "--llm-model", MODEL[provider], "--runs-dir", str(tmp_path / "runs"),
                           "--no-integrate", "--json", *extra], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=600)


MODEL = {"anthropic": "claude-sonnet-4-5", "openai": "gpt-4o"}


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
def test_llm_rounds_feed_back_results_and_record_costs(tmp_path, provider):
    script = [answer(reply(("plain torch rewrite", GOOD, None), ("wrong eps", WRONG, None)), 1200, 800),
              answer(reply(("probe", KEY_PROBE, None), ("sum instead of mean", TUNABLE, {"CHUNK": [1, 2]})), 1500, 900),
              answer("Sorry, I can't produce JSON today.", 900, 20),
              answer(reply(), 950, 10),  # asked again after the prose: nothing more to propose
              answer(reply(), 960, 10)]  # and once more with the whole round's results: still nothing
    with ReplayServer(script) as server:
        proc = tune(tmp_path, provider, server)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    summary = json.loads(proc.stdout)
    db = sqlite3.connect(Path(summary["run"]) / "trials.sqlite")
    trials = {json.loads(b)["candidate_hash"]: json.loads(b) for (b,) in db.execute("SELECT body FROM trials")}
    statuses = sorted(t["status"] for t in trials.values())
    assert statuses == ["ok", "ok", "ok", "wrong"], statuses
    assert all(t["planner"] == provider for t in trials.values())
    # The second round's prompt carries the first round's results (hashes and verdicts).
    second = json.dumps(server.requests[1].body)
    assert "Results of your last proposals" in second
    assert any(h in second for h in trials) and ("wrong" in second or "still running" in second)
    # Every call is in the store with its tokens and cost; the malformed answer is kept raw.
    calls = list(db.execute("SELECT input_tokens, output_tokens, usd, ok FROM llm_calls ORDER BY id"))
    assert [c[:2] for c in calls] == [(1200, 800), (1500, 900), (900, 20), (950, 10), (960, 10)]
    assert all(c[2] > 0 and c[3] == 1 for c in calls[:3])
    raw = [json.loads(b) for (k, b) in db.execute("SELECT kind, body FROM events") if k == "malformed_answer"]
    assert raw and "can't produce JSON" in raw[0]["raw"]
    # The prose answer was not the end: the model was asked again, told why.
    assert len(server.requests) == 5 and "could not be read" in json.dumps(server.requests[3].body)
    # The key reached the server as a header but never the recording, nor candidate code.
    assert all(r.auth_header for r in server.requests)
    assert "sk-test-not-real" not in json.dumps([r.body for r in server.requests])


def test_max_usd_stops_llm_proposals_cleanly(tmp_path):
    # One call costs 3 $ at the overridden price; the cap of 1 $ allows no second call.
    script = [answer(reply(("plain torch rewrite", GOOD, None)), 1_000_000, 0),
              answer(reply(("never asked for", WRONG, None)), 10, 10)]
    env_price = {"NIGHTSHIFT_PRICE_IN": "3.0", "NIGHTSHIFT_PRICE_OUT": "15.0"}
    os.environ.update(env_price)
    try:
        with ReplayServer(script) as server:
            proc = tune(tmp_path, "anthropic", server, "--max-usd", "1")
    finally:
        for k in env_price:
            os.environ.pop(k)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["stop_reason"].startswith("dollar cap"), summary
    assert len(server.requests) == 1
    assert summary["trials"] == 1


def test_missing_key_is_a_clear_error_before_any_work(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "agent", "tune", "--model", str(TINY), "--planner", "template,anthropic",
                           "--runs-dir", str(tmp_path / "runs")], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 2
    assert "ANTHROPIC_API_KEY" in proc.stderr and "--planner template" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
