"""A request trace turned into the workload mix the tuner measures (`--workloads TRACE.jsonl`).

The trace format (JSON Lines, one request per line; blank lines are skipped):

    {"arrival_s": 0.42, "prompt_tokens": 12000, "output_tokens": 180, "shared_prefix_tokens": 11500}

- `arrival_s`: when the request arrived, seconds from any origin (non-decreasing is not required);
- `prompt_tokens`: the prompt's length, shared prefix included (>= 1);
- `output_tokens`: tokens generated (>= 0);
- `shared_prefix_tokens`: leading prompt tokens already in the KV cache (a system prompt, the
  earlier turns of a conversation, a file read before); 0 when unknown. At most prompt_tokens.
- any other key (`id`, `model`, ...) is ignored, so a serving log's export only needs these four.

Each request is two phases: a prefill of its `prompt - shared_prefix` new tokens after
`shared_prefix` cached ones, and `output_tokens` decode steps of one token over a context of
`prompt + step` tokens. Phases fall into a few named shapes:

| shape        | phase   | rule                                   |
|--------------|---------|----------------------------------------|
| long_prefill | prefill | new tokens >= 8192                     |
| prefill      | prefill | 1024 <= new tokens < 8192              |
| turn_prefill | prefill | new tokens < 1024 (a short turn)       |
| decode       | decode  | mean context < 8192                    |
| long_decode  | decode  | mean context >= 8192                   |

A shape's representative call: prefills run one request at a time (batch 1), with the
token-weighted median new tokens (rounded up to a multiple of 64) and median cached prefix
(rounded to a multiple of 256); decode runs `batch` sequences at once, where batch is the mean
number of requests decoding concurrently (Little's law: the summed decode time of the requests,
at DECODE_STEP_S a token, over the trace's span; between 1 and `max_batch`), over the
token-weighted mean context (rounded up to a multiple of 256).

Weight = how many representative calls the trace's tokens amount to (prefill tokens / new
tokens per call; decode steps / batch). The tuner measures each shape's latency, so the
weighted latency sum(weight x latency) is the device time the trace would cost, *measured*:
no FLOP or byte model enters the weights. It assumes a shape's cost is linear in its tokens
within a bucket (attention's growth with context inside one bucket is not modelled).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from statistics import median

DECODE_STEP_S = 0.02
"""Assumed time between two tokens of one request while it decodes (for the concurrency estimate)."""
MAX_BATCH = 32
LONG_TOKENS = 8192
SHORT_TURN_TOKENS = 1024
FIELDS = ("arrival_s", "prompt_tokens", "output_tokens", "shared_prefix_tokens")


class TraceError(ValueError):
    """A trace that cannot be read, with the file and line."""


@dataclass(frozen=True)
class Request:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    shared_prefix_tokens: int = 0


@dataclass(frozen=True)
class Shape:
    """One named workload of the mix: `batch` x `new_tokens` over `context` cached tokens."""

    name: str
    batch: int
    new_tokens: int
    context: int
    weight: float
    """Representative calls the trace amounts to (the metric's weight)."""
    requests: int
    tokens: int


def _int_field(obj: dict, key: str, where: str, minimum: int) -> int:
    v = obj.get(key, 0 if key == "shared_prefix_tokens" else None)
    if v is None:
        raise TraceError(f"{where}: missing {key!r} (each line needs {', '.join(FIELDS[:3])})")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or int(v) < minimum:
        raise TraceError(f"{where}: {key} must be an integer >= {minimum}, got {v!r}")
    return int(v)


def parse_line(text: str, where: str) -> Request:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: each line must be a JSON object, got {type(obj).__name__}")
    arrival = obj.get("arrival_s")
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not math.isfinite(arrival):
        raise TraceError(f"{where}: arrival_s must be a finite number of seconds, got {arrival!r}")
    prompt = _int_field(obj, "prompt_tokens", where, 1)
    output = _int_field(obj, "output_tokens", where, 0)
    prefix = _int_field(obj, "shared_prefix_tokens", where, 0)
    if prefix >= prompt:
        raise TraceError(f"{where}: shared_prefix_tokens {prefix} must be below prompt_tokens {prompt} "
                         "(at least one prompt token is new)")
    return Request(float(arrival), prompt, output, prefix)


def read_trace(path: str | Path) -> list[Request]:
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: trace file not found")
    requests = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            requests.append(parse_line(line, f"{path}:{n}"))
    if not requests:
        raise TraceError(f"{path}: no requests (one JSON object per line)")
    return requests


def _round_up(n: float, step: int) -> int:
    return max(step, int(math.ceil(n / step)) * step)


def _weighted_median(values: list[int], weights: list[int]) -> int:
    order = sorted(range(len(values)), key=values.__getitem__)
    half, acc = sum(weights) / 2, 0
    for i in order:
        acc += weights[i]
        if acc >= half:
            return values[i]
    return values[order[-1]]


def group(requests: list[Request], max_batch: int = MAX_BATCH) -> list[Shape]:
    """The trace's named shapes and weights (see the module docstring), largest weight first."""
    prefills: dict[str, list[Request]] = {"long_prefill": [], "prefill": [], "turn_prefill": []}
    decodes: dict[str, list[Request]] = {"decode": [], "long_decode": []}
    for r in requests:
        new = r.prompt_tokens - r.shared_prefix_tokens
        kind = "long_prefill" if new >= LONG_TOKENS else "prefill" if new >= SHORT_TURN_TOKENS else "turn_prefill"
        prefills[kind].append(r)
        if r.output_tokens:
            mean_ctx = r.prompt_tokens + (r.output_tokens - 1) / 2
            decodes["long_decode" if mean_ctx >= LONG_TOKENS else "decode"].append(r)
    arrivals = [r.arrival_s for r in requests]
    span = max(arrivals) - min(arrivals) + max(r.output_tokens for r in requests) * DECODE_STEP_S
    shapes = []
    for name, rs in prefills.items():
        if not rs:
            continue
        news = [r.prompt_tokens - r.shared_prefix_tokens for r in rs]
        new = _round_up(_weighted_median(news, news), 64)
        prefix = _weighted_median([r.shared_prefix_tokens for r in rs], news)
        context = int(round(prefix / 256)) * 256
        shapes.append(Shape(name, 1, new, context, sum(news) / new, len(rs), sum(news)))
    for name, rs in decodes.items():
        if not rs:
            continue
        steps = sum(r.output_tokens for r in rs)
        busy = steps * DECODE_STEP_S
        batch = max(1, min(max_batch, int(round(busy / span)) if span > 0 else 1))
        mean_ctx = sum(r.output_tokens * (r.prompt_tokens + (r.output_tokens - 1) / 2) for r in rs) / steps
        shapes.append(Shape(name, batch, 1, _round_up(mean_ctx, 256) - 1, steps / batch, len(rs), steps))
    return sorted(shapes, key=lambda s: -s.weight)


def describe(shapes: list[Shape]) -> list[str]:
    """One line per shape, for logs and the report."""
    return [f"{s.name}: {s.batch} x {s.new_tokens} new over {s.context} cached, weight {s.weight:.1f} "
            f"({s.requests} requests, {s.tokens} tokens)" for s in shapes]
