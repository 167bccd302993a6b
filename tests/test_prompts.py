"""Every LLM prompt renders with a realistic context (StrictUndefined: a missing variable
fails), carries what the model needs, and answers are parsed or rejected cleanly."""

import pytest

from agent.history import History
from agent.planners.llm import LLMPlanner, MalformedAnswer, parse_answer, render_source, LLMCandidate
from agent.prompting import prompts_dir, render_prompt
from tools.problem import Problem
from tools.trial import Status, Trial, WorkloadTiming


class NoClient:
    provider, model = "anthropic", "none"


def realistic_history(problem: Problem, tmp_path) -> History:
    h = History({problem.name: ["cpu"]})
    good = tmp_path / "good.py"
    good.write_text("import torch\n\ndef forward(module, x):\n    return type(module).forward(module, x)\n")
    h.add(Trial(region=problem.name, candidate_hash="aaaa1111", candidate_path=str(good), planner="template",
                template="rmsnorm", status=Status.ok, error=1e-6, speedup=1.7, generation="cpu",
                timings=[WorkloadTiming(workload=w.name, baseline_ms=1.0, candidate_ms=0.6, baseline_spread=0.01,
                                        candidate_spread=0.02, reps=20, speedup=1.66) for w in problem.workloads]))
    h.add(Trial(region=problem.name, candidate_hash="bbbb2222", planner="anthropic", status=Status.wrong,
                reason="error 0.3 > tolerance abs 0.0001", error_text="", generation="cpu"))
    h.add(Trial(region=problem.name, candidate_hash="cccc3333", planner="anthropic", status=Status.compile_error,
                reason="NameError: name 'tl' is not defined", error_text="Traceback ...\nNameError: name 'tl'",
                generation="cpu"))
    return h


def test_every_llm_prompt_renders_with_a_realistic_context(frozen_run, tmp_path):
    problem = Problem.load(frozen_run / "LlamaMLP")
    history = realistic_history(problem, tmp_path)
    planner = LLMPlanner(NoClient())
    ctx = planner.context(problem, history, 3)
    system = render_prompt("llm/system.j2", tolerance_kind=problem.tolerance.kind)
    propose = render_prompt("llm/propose.j2", **ctx)
    feedback = render_prompt("llm/feedback.j2", region=problem.name, malformed="no JSON object",
                             results=[{"hash": "bbbb2222", "note": "fused", "status": "wrong", "speedup": None,
                                       "error": 0.3, "tolerance": str(problem.tolerance), "reason": "too far"}])
    assert "forward(module, *inputs)" in system and '"candidates"' in system
    for needle in ("LlamaMLP", "gate_proj", "prefill", "decode", "small_batch", str(problem.tolerance),
                   "aaaa1111", "1.70x", "bbbb2222", "error 0.3 > tolerance", "NameError", "```diff"):
        assert needle in propose, needle
    assert "bbbb2222" in feedback and "could not be read" in feedback
    names = sorted(p.name for p in (prompts_dir() / "llm").glob("*.j2"))
    assert names == ["feedback.j2", "propose.j2", "system.j2"]


def test_a_missing_variable_fails_the_render():
    import jinja2
    with pytest.raises(jinja2.UndefinedError):
        render_prompt("llm/feedback.j2", region="R")


def test_answers_are_parsed_or_rejected():
    src = "def forward(module, x):\n    return x\n"
    import json
    good = json.dumps({"candidates": [{"note": "n", "source": src, "tunables": {"B": [64, 128]}}]})
    assert parse_answer(good)[0].tunables == {"B": [64, 128]}
    assert parse_answer("Here you go:\n```json\n" + good + "\n```\nthanks")[0].source == src
    assert parse_answer("```python\n" + src + "```")[0].source == src
    for bad in ("I cannot help with that.", '{"candidates": [{"note": "no source"}]}', '{"candidates": 3}'):
        with pytest.raises(MalformedAnswer):
            parse_answer(bad)


def test_tunable_placeholders_render_strictly():
    c = LLMCandidate(source="BLOCK = {{ BLOCK }}\n", tunables={"BLOCK": [256, 512]})
    assert render_source(c, {"BLOCK": 512}) == "BLOCK = 512\n"
    import jinja2
    with pytest.raises(jinja2.UndefinedError):
        render_source(c, {})
