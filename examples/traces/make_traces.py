"""Writes the two synthetic request traces next to this file (seeded: the same files every run).

    python examples/traces/make_traces.py

- `agent.jsonl`: 12 coding-agent sessions running side by side. Each starts with a long
  context (a 2k-token system prompt, shared by all sessions, plus 6k-14k tokens of files and
  instructions), then 30 short turns: a tool result of 100-1500 new tokens (one turn in eight
  reads a whole file, 8k-12k tokens) appended to the conversation, which is the shared prefix
  already in the cache, and a reply of 30-250 tokens. Turns follow each other after the reply
  (20 ms a token) and 0.3-2 s of tool time. Contexts grow to about 24k tokens.
- `chat.jsonl`: 240 chat requests arriving as a Poisson process at 2 per second; each a
  300-token system prompt (cached, shared) plus 20-1200 tokens of user text, and a reply of
  50-700 tokens.

The format is the one tools/traffic.py reads (and documents): one JSON object per line with
arrival_s, prompt_tokens, output_tokens, shared_prefix_tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAX_CONTEXT = 24000


def agent_trace(seed: int = 17) -> list[dict]:
    rng = random.Random(seed)
    requests = []
    for session in range(12):
        t = session * 1.5
        context = 2048 + rng.randint(6000, 14000)
        prefix = 2048
        for turn in range(30):
            out = rng.randint(30, 250)
            requests.append({"id": f"agent{session}-{turn}", "arrival_s": round(t, 3), "prompt_tokens": context,
                             "output_tokens": out, "shared_prefix_tokens": prefix})
            t += out * 0.02 + rng.uniform(0.3, 2.0)
            prefix = context + out
            new = rng.randint(8000, 12000) if rng.random() < 1 / 8 else rng.randint(100, 1500)
            context = prefix + new
            if context > MAX_CONTEXT:  # the agent compacts its history: a fresh long prompt
                context, prefix = 2048 + rng.randint(6000, 14000), 2048
    return sorted(requests, key=lambda r: r["arrival_s"])


def chat_trace(seed: int = 18) -> list[dict]:
    rng = random.Random(seed)
    requests, t = [], 0.0
    for i in range(240):
        t += rng.expovariate(2.0)
        requests.append({"id": f"chat{i}", "arrival_s": round(t, 3), "prompt_tokens": 300 + rng.randint(20, 1200),
                         "output_tokens": rng.randint(50, 700), "shared_prefix_tokens": 300})
    return requests


def write(path: Path, requests: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))


if __name__ == "__main__":
    write(HERE / "agent.jsonl", agent_trace())
    write(HERE / "chat.jsonl", chat_trace())
    print(f"wrote {HERE / 'agent.jsonl'} and {HERE / 'chat.jsonl'}")
