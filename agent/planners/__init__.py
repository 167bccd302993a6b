"""Planners propose candidates; they are chosen by name (`--planner template,anthropic`)."""

from __future__ import annotations

from agent.planners.base import Combined, Planner, PlannerError, PlannerFailed

__all__ = ["Combined", "Planner", "PlannerError", "PlannerFailed", "make_planner", "PLANNERS"]

PLANNERS = ("template", "compiler", "files", "anthropic", "openai")


def make_planner(spec: str, **options) -> Planner:
    """`template`, `compiler`, `files`, `anthropic`, `openai`, or several joined by commas. LLM planners
    need their API key; a missing key is an error, never a silent switch to another planner."""
    from agent.planners.compiler import CompilerPlanner
    from agent.planners.files import FilesPlanner
    from agent.planners.template import TemplatePlanner

    def llm(provider: str):
        def build(**opts):
            from agent.llm import make_client
            from agent.planners.llm import LLMPlanner
            client = make_client(provider, model=opts.get("llm_model"), base_url=opts.get("base_url"))
            return LLMPlanner(client, **opts)
        return build

    table = {"template": TemplatePlanner, "compiler": CompilerPlanner, "files": FilesPlanner, "anthropic": llm("anthropic"),
             "openai": llm("openai")}
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in table]
    if not names or unknown:
        raise PlannerError(f"unknown planner {', '.join(unknown) or spec!r}: choose from {', '.join(table)}")
    if len(set(names)) != len(names):
        raise PlannerError(f"--planner {spec!r} names a planner twice")
    planners = [table[n](**options) for n in names]
    return planners[0] if len(planners) == 1 else Combined(planners, options.get("on_failure", lambda e: None))
