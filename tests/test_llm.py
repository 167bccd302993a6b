"""The LLM clients, through the real Anthropic and OpenAI SDKs, against a local replay server."""

import sqlite3
import time

import pytest

from agent.planners.llm_client import LLMError, make_client, price
from agent.planners import PlannerError
from tests.replay_server import ReplayServer, answer, delay, error, reset
from tools.store import Store

PROVIDERS = ["anthropic", "openai"]
KEYS = {"anthropic": "sk-ant-test-fake-0123456789", "openai": "sk-test-fake-0123456789"}
ENV = ["ANTHROPIC_API_KEY", "OPENAI_API_KEY", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_BASE_URL", "OPENAI_BASE_URL",
       "NIGHTSHIFT_ANTHROPIC_MODEL", "NIGHTSHIFT_OPENAI_MODEL", "NIGHTSHIFT_PRICE_IN", "NIGHTSHIFT_PRICE_OUT",
       "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"]
FAST = dict(timeout=5.0, max_attempts=4, backoff=(0.01, 0.05))


@pytest.fixture(autouse=True)
def env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEYS["anthropic"])
    monkeypatch.setenv("OPENAI_API_KEY", KEYS["openai"])


@pytest.fixture
def serve():
    servers = []

    def start(provider: str, script: list) -> ReplayServer:
        servers.append(ReplayServer(script, api_key=KEYS[provider]).start())
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def base_url(provider: str, server: ReplayServer) -> str:
    # Anthropic's SDK appends /v1/messages; OpenAI's appends /chat/completions to a base ending in /v1.
    return server.url if provider == "anthropic" else server.url + "/v1"


def client(provider: str, server: ReplayServer, **options):
    return make_client(provider, base_url=base_url(provider, server), **{**FAST, **options})


def ask(c, text: str = "write a faster RMSNorm"):
    return c.complete("You write Triton kernels.", [{"role": "user", "content": text}])


@pytest.mark.parametrize("provider", PROVIDERS)
def test_answer_returns_text_tokens_and_cost_into_the_store(provider, serve, tmp_path):
    server = serve(provider, [answer("```python\ndef forward(m, x): ...\n```", input_tokens=1200, output_tokens=300)])
    model = {"anthropic": "claude-sonnet-5-5", "openai": "gpt-6.1-sol"}[provider]  # both $2 / $10 per Mtok
    history = [{"role": "user", "content": "round 1"}, {"role": "assistant", "content": "candidate A"},
               {"role": "user", "content": "candidate A: wrong, max abs error 0.3"}]
    reply = client(provider, server, model=model).complete("You write Triton kernels.", history)

    assert reply.text == "```python\ndef forward(m, x): ...\n```"
    assert (reply.input_tokens, reply.output_tokens, reply.attempts) == (1200, 300, 1)
    assert reply.priced and reply.usd == pytest.approx((1200 * 2 + 300 * 10) / 1e6)
    assert (reply.provider, reply.model) == (provider, model)

    sent = server.requests[0].body
    assert sent["model"] == model
    if provider == "anthropic":
        assert server.requests[0].path == "/v1/messages"
        assert sent["system"] == "You write Triton kernels." and sent["messages"] == history
    else:
        assert server.requests[0].path == "/v1/chat/completions"
        assert sent["messages"] == [{"role": "system", "content": "You write Triton kernels."}, *history]

    store = Store(tmp_path / "run.db")
    store.record_llm_call(reply, purpose="propose LlamaRMSNorm")
    store.record_llm_call(LLMError("openai x: HTTP 500", provider=provider, model=model, status=500, attempts=4))
    assert store.llm_usd() == pytest.approx(reply.usd)
    rows = store.db.execute("SELECT provider, model, input_tokens, output_tokens, attempts, ok, error, purpose"
                            " FROM llm_calls ORDER BY id").fetchall()
    assert rows == [(provider, model, 1200, 300, 1, 1, None, "propose LlamaRMSNorm"),
                    (provider, model, 0, 0, 4, 0, "openai x: HTTP 500", None)]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_malformed_answer_comes_back_as_it_is(provider, serve):
    server = serve(provider, [answer("Sure! Here is my plan, no code yet."), answer("never asked for")])
    reply = ask(client(provider, server))
    assert reply.text == "Sure! Here is my plan, no code yet." and len(server.requests) == 1


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("status,header", [(429, {"retry-after": "0.4"}), (529, {"retry-after-ms": "400"})])
def test_retry_after_is_honoured(provider, status, header, serve, caplog):
    server = serve(provider, [error(status, headers=header), answer("ok")])
    reply = ask(client(provider, server))
    assert reply.text == "ok" and reply.attempts == 2
    assert f"HTTP {status}: replayed error {status}; attempt 1 of 4, retrying in 0.40 s" in caplog.text
    gap = server.requests[1].at - server.requests[0].at
    assert gap >= 0.4, f"retried after {gap:.3f} s, server asked for 0.4 s"  # our backoff alone is <= 0.05 s


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("failure", [error(500), error(529), error(503), delay(1.5), reset()],
                         ids=["500", "529", "503", "timeout", "reset"])
def test_transient_failure_then_success_is_retried(provider, failure, serve):
    server = serve(provider, [failure, answer("ok", input_tokens=7, output_tokens=3)])
    reply = ask(client(provider, server, timeout=0.4))
    assert reply.text == "ok" and reply.attempts == 2 and len(server.requests) == 2
    assert (reply.input_tokens, reply.output_tokens) == (7, 3)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_retries_are_capped(provider, serve):
    server = serve(provider, [error(500, "upstream overloaded")] * 6)
    with pytest.raises(LLMError) as e:
        ask(client(provider, server, max_attempts=3))
    assert len(server.requests) == 3 and e.value.attempts == 3 and e.value.status == 500
    assert "HTTP 500" in str(e.value) and "upstream overloaded" in str(e.value) and "3 attempts" in str(e.value)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("status", [400, 401, 404])
def test_client_errors_are_not_retried(provider, status, serve):
    server = serve(provider, [error(status, "max_tokens: 999999 > 128000"), answer("never")])
    with pytest.raises(LLMError) as e:
        ask(client(provider, server))
    assert len(server.requests) == 1 and e.value.status == status and e.value.attempts == 1
    assert f"HTTP {status}" in str(e.value) and "max_tokens: 999999 > 128000" in str(e.value)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("value", [None, "", "  "])
def test_missing_key_names_the_variable_and_the_template_planner(provider, value, monkeypatch):
    name = {"anthropic": "ANTHROPIC_API_KEY", "openai": "OPENAI_API_KEY"}[provider]
    if value is None:
        monkeypatch.delenv(name)
    else:
        monkeypatch.setenv(name, value)
    with pytest.raises(PlannerError) as e:
        make_client(provider)
    assert name in str(e.value) and "--planner template" in str(e.value)


def test_unknown_provider_is_refused():
    with pytest.raises(PlannerError, match="anthropic, openai"):
        make_client("gemini")


@pytest.mark.parametrize("provider", PROVIDERS)
def test_the_key_reaches_the_server_but_is_never_recorded_or_logged(provider, serve, tmp_path, caplog):
    key = KEYS[provider]
    # A 401 that echoes the key back, as some providers do, after one retried 429.
    server = serve(provider, [error(429, headers={"retry-after": "0"}), error(401, f"Incorrect API key provided: {key}")])
    caplog.set_level("DEBUG")
    with pytest.raises(LLMError) as e:
        ask(client(provider, server))
    assert [r.auth_header is not None and r.auth_ok for r in server.requests] == [True, True]
    store = Store(tmp_path / "run.db")
    store.record_llm_call(e.value)
    store.close()
    assert "HTTP 401" in str(e.value) and "<redacted>" in str(e.value)
    assert "HTTP 429" in caplog.text  # the retry was logged ...
    for where in (str(e.value), caplog.text, repr(server.requests), (tmp_path / "run.db").read_bytes().decode("latin-1")):
        assert key not in where  # ... and the key nowhere


@pytest.mark.parametrize("provider", PROVIDERS)
def test_model_and_base_url_from_the_environment(provider, serve, monkeypatch):
    server = serve(provider, [answer("ok")])
    monkeypatch.setenv(f"NIGHTSHIFT_{provider.upper()}_MODEL", "my-model-7")
    monkeypatch.setenv(f"{provider.upper()}_BASE_URL", base_url(provider, server))
    reply = ask(make_client(provider, **FAST))
    assert server.requests[0].body["model"] == "my-model-7" == reply.model


@pytest.mark.parametrize("provider", PROVIDERS)
def test_an_unknown_model_costs_nothing_and_says_so(provider, serve, monkeypatch):
    server = serve(provider, [answer("ok", 1000, 1000), answer("ok", 1000, 1000)])
    reply = ask(client(provider, server, model="llama-3-70b-local"))
    assert reply.usd == 0.0 and not reply.priced
    monkeypatch.setenv("NIGHTSHIFT_PRICE_IN", "0.5")
    monkeypatch.setenv("NIGHTSHIFT_PRICE_OUT", "1.5")
    reply = ask(client(provider, server, model="llama-3-70b-local"))
    assert reply.priced and reply.usd == pytest.approx((1000 * 0.5 + 1000 * 1.5) / 1e6)


def test_price_table(monkeypatch):
    assert price("claude-haiku-4-5-20251001") == price("claude-haiku-4-5") == (1.0, 5.0)
    assert price("gpt-5-2025-08-07") == (1.25, 10.0)
    assert price("claude-opus-5-5") == (4.0, 20.0) != price("claude-opus-5")
    assert price("claude-opus-9-9") is None and price("gpt-5.9") is None  # newer versions are not guessed
    monkeypatch.setenv("NIGHTSHIFT_PRICE_OUT", "12")
    assert price("claude-opus-5-5") == (4.0, 12.0) and price("unknown") is None
    monkeypatch.setenv("NIGHTSHIFT_PRICE_IN", "-1")
    with pytest.raises(PlannerError, match="NIGHTSHIFT_PRICE_IN"):
        make_client("anthropic")


def test_old_store_without_the_table_reads_zero(tmp_path):
    path = tmp_path / "old.db"
    sqlite3.connect(path).execute("CREATE TABLE trials (id INTEGER)").connection.commit()
    assert Store(path, readonly=True).llm_usd() == 0.0


def test_the_backoff_comes_from_the_environment_and_a_bad_one_is_named(monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test-not-real-0000")
    monkeypatch.setenv("NIGHTSHIFT_LLM_BACKOFF", "0.5,2")
    waits = make_client("anthropic")._backoff
    assert (waits.multiplier, waits.max) == (0.5, 2.0)
    for bad in ("fast", "2,1", "-1,3", "1,inf", "1"):
        monkeypatch.setenv("NIGHTSHIFT_LLM_BACKOFF", bad)
        with pytest.raises(PlannerError, match="NIGHTSHIFT_LLM_BACKOFF"):
            make_client("anthropic")
