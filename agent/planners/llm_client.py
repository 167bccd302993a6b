"""LLM clients for the LLM planners: one `complete(system, messages) -> Reply` over the official SDKs.

The SDKs' own retries are off (`max_retries=0`); tenacity retries here instead, so every
attempt is counted and logged, the backoff is ours to set, and a failure that stays failed
comes back as one `LLMError` whatever the provider. Retried: 429, 5xx (529 overloaded
included), timeouts, refused and reset connections, and a 200 whose body is not the API's
answer (truncated JSON, an HTML page from a proxy); a `retry-after-ms` / `retry-after`
header is honoured (capped at `RETRY_AFTER_CAP` seconds). Other 4xx are the caller's
mistake and fail at once. API keys come only from the environment and never appear in
errors or logs.
"""

from __future__ import annotations

import email.utils
import logging
import math
import os
import re
import time
from typing import Protocol

import tenacity
from pydantic import BaseModel

from agent.planners.base import PlannerError

log = logging.getLogger(__name__)

KEY_ENV = {"anthropic": "ANTHROPIC_API_KEY", "openai": "OPENAI_API_KEY"}
MODEL_ENV = {"anthropic": "NIGHTSHIFT_ANTHROPIC_MODEL", "openai": "NIGHTSHIFT_OPENAI_MODEL"}
DEFAULT_MODEL = {"anthropic": "claude-sonnet-5-5", "openai": "gpt-6.1-sol"}
RETRY_AFTER_CAP = 60.0  # seconds; a server asking for longer still gets retried, just sooner

# USD per million (input, output) tokens: list prices as of November 2026, from Anthropic's
# and OpenAI's pricing pages. Cache, batch, priority and long-prompt rates are ignored (Haiku
# 5.5 costs 5x for prompts over 100k tokens; GPT-5.x/6.x 2x input over 272k), so this is an
# estimate. A key prices that model and its dated snapshots (claude-haiku-4-5-20251001), not
# newer versions: an unknown model costs 0 and its Reply says priced=False. Set
# NIGHTSHIFT_PRICE_IN / NIGHTSHIFT_PRICE_OUT (USD per Mtok) to override for any model.
PRICES: dict[str, tuple[float, float]] = {
    "claude-fable-5-1": (10.0, 50.0), "claude-fable-5": (10.0, 50.0),
    "claude-mythos-5-1": (10.0, 50.0), "claude-mythos-5": (10.0, 50.0),
    "claude-opus-5-5": (4.0, 20.0), "claude-opus-5": (5.0, 25.0),
    "claude-opus-4-8": (5.0, 25.0), "claude-opus-4-7": (5.0, 25.0),
    "claude-opus-4-6": (5.0, 25.0), "claude-opus-4-5": (5.0, 25.0),
    "claude-opus-4-1": (15.0, 75.0), "claude-opus-4": (15.0, 75.0),
    "claude-sonnet-5-5": (2.0, 10.0), "claude-sonnet-5": (2.0, 10.0),
    "claude-sonnet-4-6": (3.0, 15.0), "claude-sonnet-4-5": (3.0, 15.0), "claude-sonnet-4": (3.0, 15.0),
    "claude-haiku-5-5": (0.10, 0.50), "claude-haiku-4-5": (1.0, 5.0), "claude-3-5-haiku": (0.80, 4.0),
    "gpt-6.1-sol": (2.0, 10.0), "gpt-6.1-terra": (1.0, 5.0),
    "gpt-6-sol": (2.0, 10.0), "gpt-6-luna": (0.10, 0.50),
    "gpt-5.6-sol": (5.0, 30.0), "gpt-5.6-terra": (2.0, 12.0), "gpt-5.6-luna": (0.20, 1.20),
    "gpt-5.5": (5.0, 30.0), "gpt-5.5-pro": (30.0, 180.0),
    "gpt-5.4": (2.50, 15.0), "gpt-5.4-nano": (0.20, 1.25), "gpt-5.2": (1.75, 14.0),
    "gpt-5.1": (1.25, 10.0), "gpt-5": (1.25, 10.0), "gpt-5-mini": (0.25, 2.0), "gpt-5-nano": (0.05, 0.40),
    "gpt-4.1": (2.0, 8.0), "gpt-4.1-mini": (0.40, 1.60), "gpt-4o": (2.50, 10.0), "gpt-4o-mini": (0.15, 0.60),
    "o3": (2.0, 8.0), "o4-mini": (1.10, 4.40),
}
_SNAPSHOT = re.compile(r"-(\d{8}|\d{4}-\d{2}-\d{2})$")


class Reply(BaseModel):
    text: str
    input_tokens: int
    output_tokens: int
    usd: float
    priced: bool  # False: the model has no price here (usd is 0), see PRICES
    model: str  # as the API reported it
    provider: str
    seconds: float  # wall time of the whole call, retries and waits included
    attempts: int


class LLMClient(Protocol):
    provider: str
    model: str

    def complete(self, system: str, messages: list[dict]) -> Reply:
        """One completion; messages are [{"role": "user" | "assistant", "content": str}]."""
        ...


class MalformedResponse(Exception):
    """The API answered 200 with a body that is not a completion (what the SDK could not read)."""


class LLMError(Exception):
    """A call that failed for good: a non-retryable error, or every attempt used up."""

    def __init__(self, message: str, *, provider: str, model: str, status: int | None = None,
                 attempts: int = 1, seconds: float = 0.0):
        super().__init__(message)
        self.provider, self.model, self.status = provider, model, status
        self.attempts, self.seconds = attempts, seconds


def price(model: str) -> tuple[float, float] | None:
    """USD per Mtok (input, output) for `model`, the environment's override first; None if unknown."""
    override = [_env_price(name) for name in ("NIGHTSHIFT_PRICE_IN", "NIGHTSHIFT_PRICE_OUT")]
    known = PRICES.get(_SNAPSHOT.sub("", model))
    if known is None and None in override:
        return None
    base = known or (0.0, 0.0)
    return (override[0] if override[0] is not None else base[0],
            override[1] if override[1] is not None else base[1])


def _env_price(name: str) -> float | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise PlannerError(f"{name}={raw!r}: give a price in USD per million tokens, e.g. {name}=3.0")
    return value


def make_client(provider: str, model: str | None = None, base_url: str | None = None, timeout: float = 120.0,
                max_attempts: int = 5, backoff: tuple[float, float] | None = None, **options) -> LLMClient:
    """A client for `provider` ("anthropic" or "openai") with its key from the environment.

    `base_url` defaults to the SDK's own (ANTHROPIC_BASE_URL / OPENAI_BASE_URL, else the
    provider's API); an OpenAI-compatible local server works with provider "openai".
    `backoff` is (base, cap) in seconds for the exponential, jittered waits between attempts
    (default: $NIGHTSHIFT_LLM_BACKOFF as `BASE,CAP`, else 1 and 30 s).
    """
    table = {"anthropic": AnthropicClient, "openai": OpenAIClient}
    if provider not in table:
        raise PlannerError(f"unknown LLM provider {provider!r}: choose from {', '.join(table)}")
    key = os.environ.get(KEY_ENV[provider], "").strip()
    if not key:
        hint = " (a local server that takes no key accepts any value)" if provider == "openai" and base_url else ""
        raise PlannerError(f"the {provider} planner needs an API key: set {KEY_ENV[provider]}{hint}, "
                           "or use --planner template, which needs no key")
    if max_attempts < 1 or timeout <= 0:
        raise PlannerError(f"max_attempts must be >= 1 and timeout > 0 (got {max_attempts}, {timeout})")
    backoff = backoff or _env_backoff()
    model = model or os.environ.get(MODEL_ENV[provider]) or DEFAULT_MODEL[provider]
    price(model)  # a malformed price override fails now, not after the first paid call
    return table[provider](key, model, base_url, timeout, max_attempts, backoff, **options)


def _env_backoff() -> tuple[float, float]:
    text = os.environ.get("NIGHTSHIFT_LLM_BACKOFF", "").strip()
    if not text:
        return 1.0, 30.0
    try:
        base, cap = (float(x) for x in text.split(","))
    except ValueError:
        base = cap = float("nan")
    if not (0 <= base <= cap < float("inf")):
        raise PlannerError(f"NIGHTSHIFT_LLM_BACKOFF={text!r}: give BASE,CAP in seconds, 0 <= BASE <= CAP (e.g. 1,30)")
    return base, cap


class _SDKClient:
    """What both providers share: the retry loop, the accounting and the error messages."""
    provider = ""

    def __init__(self, sdk, key: str, model: str, timeout: float, max_attempts: int,
                 backoff: tuple[float, float]):
        self._sdk, self._key, self.model = sdk, key, model
        self.timeout, self.max_attempts = timeout, max_attempts
        self._backoff = tenacity.wait_random_exponential(multiplier=backoff[0], max=backoff[1])

    def _call(self, system: str, messages: list[dict]) -> tuple[str, int, int, str]:
        """(text, input tokens, output tokens, model) of one request; raises the SDK's errors."""
        raise NotImplementedError

    def complete(self, system: str, messages: list[dict]) -> Reply:
        start, attempts = time.monotonic(), 0

        def attempt():
            nonlocal attempts
            attempts += 1
            try:
                return self._call(system, messages)
            except self._sdk.APIResponseValidationError as e:
                raise MalformedResponse(f"the API's answer does not have the expected shape ({e.message})") from None
            except self._sdk.APIError:
                raise
            except (ValueError, TypeError, AttributeError, KeyError, IndexError) as e:
                raise MalformedResponse(f"the API answered with a body that is not a completion "
                                        f"({type(e).__name__}: {str(e)[:200]})") from None

        retrying = tenacity.Retrying(stop=tenacity.stop_after_attempt(self.max_attempts), wait=self._wait,
                                     retry=tenacity.retry_if_exception(self._transient),
                                     before_sleep=self._log_retry, reraise=True)
        try:
            text, tokens_in, tokens_out, model = retrying(attempt)
        except MalformedResponse as e:
            raise LLMError(f"{self.provider} {self.model}: {e}; gave up after {attempts} attempts",
                           provider=self.provider, model=self.model, status=200, attempts=attempts,
                           seconds=time.monotonic() - start) from None
        except self._sdk.APIError as e:
            seconds = time.monotonic() - start
            why = self._describe(e)
            if self._transient(e):
                why += f"; gave up after {attempts} attempts"
            elif attempts > 1:
                why += f" (on attempt {attempts}, after transient failures)"
            raise LLMError(f"{self.provider} {self.model}: {why}", provider=self.provider, model=self.model,
                           status=getattr(e, "status_code", None), attempts=attempts, seconds=seconds) from None
        rates = price(model)
        usd = (tokens_in * rates[0] + tokens_out * rates[1]) / 1e6 if rates else 0.0
        return Reply(text=text, input_tokens=tokens_in, output_tokens=tokens_out, usd=usd, priced=rates is not None,
                     model=model, provider=self.provider, seconds=time.monotonic() - start, attempts=attempts)

    def _transient(self, e: BaseException) -> bool:
        if isinstance(e, (self._sdk.APIConnectionError, MalformedResponse)):  # timeouts are connection errors too
            return True
        return isinstance(e, self._sdk.APIStatusError) and (e.status_code == 429 or e.status_code >= 500)

    def _wait(self, state: tenacity.RetryCallState) -> float:
        after = _retry_after(state.outcome.exception())
        return min(after, RETRY_AFTER_CAP) if after is not None else self._backoff(state)

    def _log_retry(self, state: tenacity.RetryCallState) -> None:
        log.warning("%s %s: %s; attempt %d of %d, retrying in %.2f s", self.provider, self.model,
                    self._describe(state.outcome.exception()), state.attempt_number, self.max_attempts,
                    state.upcoming_sleep)

    def _describe(self, e: BaseException) -> str:
        if isinstance(e, MalformedResponse):
            text = str(e)
        elif isinstance(e, self._sdk.APITimeoutError):
            text = f"no answer within {self.timeout:g} s"
        elif isinstance(e, self._sdk.APIStatusError):
            body = e.body.get("error", e.body) if isinstance(e.body, dict) else e.body
            detail = body.get("message") if isinstance(body, dict) else body
            text = f"HTTP {e.status_code}: {detail or e.message}"
        elif isinstance(e, self._sdk.APIConnectionError):
            cause = e.__cause__ or e.__context__
            text = f"connection failed ({cause or e})"
        else:
            text = str(e)
        # A provider may echo part of the key back (OpenAI's 401 does); never pass it on.
        return text.replace(self._key, "<redacted>") if self._key else text


def _retry_after(e: BaseException | None) -> float | None:
    """Seconds the server asked us to wait (`retry-after-ms`, else `retry-after`), if it did."""
    headers = getattr(getattr(e, "response", None), "headers", None)
    if not headers:
        return None
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            value = float(raw) * scale
        except ValueError:  # an HTTP date
            when = email.utils.parsedate_to_datetime(raw) if name == "retry-after" else None
            value = when.timestamp() - time.time() if when else math.nan
        if math.isfinite(value):
            return max(0.0, value)
    return None


def _check_parsed(response) -> None:
    """The SDKs hand back a body that is not JSON (a proxy's HTML page) as a plain string."""
    if isinstance(response, (str, bytes)):
        snippet = " ".join(str(response)[:120].split())
        raise MalformedResponse(f"the API answered with a body that is not JSON ({snippet!r})")


class AnthropicClient(_SDKClient):
    provider = "anthropic"

    def __init__(self, key: str, model: str, base_url: str | None, timeout: float, max_attempts: int,
                 backoff: tuple[float, float], max_tokens: int = 8192):
        import anthropic
        super().__init__(anthropic, key, model, timeout, max_attempts, backoff)
        self.max_tokens = max_tokens
        self._client = anthropic.Anthropic(api_key=key, base_url=base_url, max_retries=0, timeout=timeout)

    def _call(self, system: str, messages: list[dict]) -> tuple[str, int, int, str]:
        r = self._client.messages.create(model=self.model, max_tokens=self.max_tokens, system=system,
                                         messages=messages)
        _check_parsed(r)
        text = "".join(block.text for block in r.content if block.type == "text")
        return text, r.usage.input_tokens, r.usage.output_tokens, r.model or self.model


class OpenAIClient(_SDKClient):
    provider = "openai"

    def __init__(self, key: str, model: str, base_url: str | None, timeout: float, max_attempts: int,
                 backoff: tuple[float, float], max_tokens: int | None = None):
        import openai
        super().__init__(openai, key, model, timeout, max_attempts, backoff)
        # No default cap: reasoning models spend hidden tokens first, and a cap cuts the answer.
        self.max_tokens = max_tokens
        # base_url=None would override OPENAI_BASE_URL with the default, so it is only passed when given.
        extra = {"base_url": base_url} if base_url else {}
        self._client = openai.OpenAI(api_key=key, max_retries=0, timeout=timeout, **extra)

    def _call(self, system: str, messages: list[dict]) -> tuple[str, int, int, str]:
        limit = {"max_completion_tokens": self.max_tokens} if self.max_tokens else {}
        r = self._client.chat.completions.create(
            model=self.model, messages=[{"role": "system", "content": system}, *messages], **limit)
        _check_parsed(r)
        text = (r.choices[0].message.content or "") if r.choices else ""
        usage = r.usage
        return (text, usage.prompt_tokens if usage else 0, usage.completion_tokens if usage else 0,
                r.model or self.model)
