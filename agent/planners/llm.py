"""The LLM planner: a model reads the hotspot, the roofline numbers and what has been tried,
and proposes kernel rewrites and fusions. The tolerance still decides.

Each region keeps its own short conversation: the first message is the problem (rendered from
`prompts/llm/propose.j2`), and every later round starts with the results of the model's last
proposals (`feedback.j2`) followed by the refreshed problem, so the model learns from what
failed. Answers are parsed into candidates with pydantic; an answer that cannot be read
(prose, an empty or null message, broken JSON) is recorded with its raw text, and the model is
asked again, told why, up to `MAX_ASKS` times per proposal. Calls and their cost go to the
run's store; past `--max-usd` the planner stops proposing, cleanly. An API failure that the
client's retries could not get past (a 401, a run of 5xx) stops the planner for the session:
`failure` says why, in the provider's words, and `notify` says it at once.
"""

from __future__ import annotations

import difflib
import re
import threading
from typing import Any, Callable

import jinja2
from pydantic import BaseModel, Field, ValidationError

from agent.history import History
from agent.prompting import render_prompt
from tools.problem import Problem
from tools.trial import Candidate

KEEP_EXCHANGES = 2
"""Past (answer, feedback) pairs kept in a region's conversation, besides the first prompt."""
MAX_ASKS = 3
"""Answers asked for per proposal before unreadable ones end it (each is recorded)."""
UNREADABLE = ("Your last answer could not be read: {why}. Answer again with only the JSON object "
              'described above: {{"candidates": [{{"source": "...", "note": "..."}}]}}.')


class LLMCandidate(BaseModel):
    source: str
    note: str = ""
    tunables: dict[str, list[int | float | str | bool]] = Field(default_factory=dict)


class LLMAnswer(BaseModel):
    candidates: list[LLMCandidate]


class MalformedAnswer(ValueError):
    pass


def parse_answer(text: str) -> list[LLMCandidate]:
    """The JSON object the prompt asks for; failing that, fenced python blocks."""
    body = text.strip()
    fenced = re.search(r"```(?:json)?\s*(\{.*\})\s*```", body, re.S)
    candidates_json = fenced.group(1) if fenced else body[body.find("{"): body.rfind("}") + 1]
    if candidates_json:
        try:
            return LLMAnswer.model_validate_json(candidates_json).candidates
        except ValidationError as e:
            json_error = f"not the expected JSON: {e.errors()[0]['msg']}"
    else:
        json_error = "no JSON object"
    blocks = [b for b in re.findall(r"```python\s*\n(.*?)```", body, re.S) if "def forward" in b]
    if blocks:
        return [LLMCandidate(source=b) for b in blocks]
    raise MalformedAnswer(json_error)


def render_source(c: LLMCandidate, values: dict[str, Any]) -> str:
    """Fill `{{ NAME }}` placeholders of a tunable candidate (strict: every name must be given)."""
    if not c.tunables:
        return c.source
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return env.from_string(c.source).render(**values)


def _ms(value: float | None) -> str:
    return f"{value:.4f} ms" if value else "unknown"


class LLMPlanner:
    def __init__(self, client, record: Callable[..., None] = lambda **kw: None,
                 usd_spent: Callable[[], float] = lambda: 0.0, max_usd: float | None = None,
                 device: str = "the target GPU", notify: Callable[[str], None] = lambda reason: None, **_):
        self.client = client
        self.name = client.provider
        self.record = record
        self.usd_spent = usd_spent
        self.max_usd = max_usd
        self.device = device
        self.conversations: dict[str, list[dict]] = {}
        self.proposed: dict[str, list[tuple[str, str]]] = {}
        self.malformed: dict[str, str] = {}
        self.stopped = ""
        """Why the planner proposes nothing any more ('' while it still does)."""
        self.failure = ""
        """The same, when the reason is a failure (the API, unreadable answers), not a cap."""
        self.notify = notify
        self.lock = threading.Lock()

    def _stop(self, reason: str, failure: bool) -> list[Candidate]:
        if not self.stopped:
            self.stopped = reason
            self.failure = reason if failure else ""
            if failure:
                self.notify(reason)
        return []

    def propose(self, problem: Problem, history: History, n: int) -> list[Candidate]:
        if self.stopped:
            return []
        if self.max_usd is not None and self.usd_spent() >= self.max_usd:
            return self._stop(f"dollar cap: ${self.usd_spent():.2f} spent of ${self.max_usd:.2f}", failure=False)
        messages = self._messages(problem, history, n)
        from agent.planners.llm_client import LLMError
        system = render_prompt("llm/system.j2", tolerance_kind=problem.tolerance.kind)
        for ask in range(1, MAX_ASKS + 1):
            try:
                reply = self.client.complete(system, messages)
            except LLMError as e:
                self.record(kind="llm_error", region=problem.name, error=str(e))
                return self._stop(f"{self.name} planner stopped: {e}", failure=True)
            self.record(kind="llm_call", region=problem.name, reply=reply)
            messages = messages + [{"role": "assistant", "content": reply.text}]
            try:
                parsed = parse_answer(reply.text)
                break
            except MalformedAnswer as e:
                self.malformed[problem.name] = str(e)
                self.record(kind="malformed_answer", region=problem.name, error=str(e), raw=reply.text[:20000])
                if ask == MAX_ASKS:
                    self.conversations[problem.name] = messages
                    return self._stop(f"{self.name} planner stopped: {MAX_ASKS} answers in a row for "
                                      f"{problem.name} could not be read (the last: {e})", failure=True)
                if self.max_usd is not None and self.usd_spent() >= self.max_usd:
                    return self._stop(f"dollar cap: ${self.usd_spent():.2f} spent of ${self.max_usd:.2f}",
                                      failure=False)
                messages = messages + [{"role": "user", "content": UNREADABLE.format(why=e)}]
        self.conversations[problem.name] = messages
        self.malformed.pop(problem.name, None)
        out = []
        for c in parsed[:n]:
            values = {k: v[0] for k, v in c.tunables.items() if v}
            try:
                source = render_source(c, values)
            except jinja2.TemplateError as e:
                self.record(kind="malformed_answer", region=problem.name, error=f"placeholders: {e}",
                            raw=c.source[:20000])
                continue
            params = {"tunables": c.tunables, "tune": values, "template_source": c.source} if c.tunables else {}
            out.append(Candidate(region=problem.name, source=source, planner=self.name, params=params,
                                 note=c.note[:500]))
        # Results still running now are reported in a later round's feedback, not lost.
        self.proposed.setdefault(problem.name, []).extend((c.hash, c.note) for c in out)
        return out

    # -- the conversation ----------------------------------------------------------------------
    def _messages(self, problem: Problem, history: History, n: int) -> list[dict]:
        past = self.conversations.get(problem.name, [])
        propose = render_prompt("llm/propose.j2", **self.context(problem, history, n))
        if not past:
            return [{"role": "user", "content": propose}]
        feedback = render_prompt("llm/feedback.j2", region=problem.name, results=self._results(problem, history),
                                 malformed=self.malformed.get(problem.name, ""))
        # The first prompt, then the last few exchanges: enough memory, bounded cost.
        head, tail = past[:1], past[1:][-(2 * KEEP_EXCHANGES - 1):]
        if tail and tail[0]["role"] != "assistant":
            tail = tail[1:]
        return head + tail + [{"role": "user", "content": feedback + "\n\n" + propose}]

    def _results(self, problem: Problem, history: History) -> list[dict]:
        """Every proposal not yet reported: finished ones with their verdict (then dropped from
        the pending list), running ones as such (reported again next round)."""
        out, pending = [], []
        for digest, note in self.proposed.get(problem.name, []):
            rec = history.records.get((problem.name, digest))
            if rec is None:
                pending.append((digest, note))
                out.append({"hash": digest, "note": note, "status": "still running", "speedup": None,
                            "error": None, "tolerance": str(problem.tolerance), "reason": ""})
                continue
            t = rec.failed() or next(iter(rec.by_generation.values()))
            out.append({"hash": digest, "note": note, "status": t.status.value, "speedup": t.speedup,
                        "error": t.error, "tolerance": str(problem.tolerance), "reason": t.reason})
        self.proposed[problem.name] = pending
        return out

    def context(self, problem: Problem, history: History, n: int) -> dict[str, Any]:
        gens = history.targets(problem.name)
        best = []
        for rec in history.kept(problem.name)[:3]:
            t = next(iter(rec.by_generation.values()))
            source = _source_of(t.candidate_path)
            diff = "".join(difflib.unified_diff(problem.region_source.splitlines(True), source.splitlines(True),
                                                "original", rec.candidate_hash, n=2))
            best.append({"hash": rec.candidate_hash, "planner": rec.planner, "template": rec.template,
                         "speedup": rec.score(gens), "error": t.error or 0.0, "timings": t.timings,
                         "diff": diff[:6000]})
        failures = [{"hash": t.candidate_hash, "status": t.status.value, "reason": t.reason[:300],
                     "error_text": t.error_text[-800:].strip()} for t in history.failures(problem.name, 5)]
        from agent.planners.kv_cache import mix
        return {"problem": problem, "weights": problem.weights, "device": self.device, "best": best,
                "failures": failures, "n": n, "fmt_ms": _ms, "mix": mix(problem) if problem.inplace_inputs else []}


def _source_of(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except (OSError, TypeError):
        return ""
