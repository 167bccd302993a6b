"""Planners propose candidates; they are chosen by name (`--planner template,anthropic`)."""

from __future__ import annotations

from agent.planners.base import Combined, Fallback, Planner, PlannerError, PlannerFailed

__all__ = ["Combined", "Fallback", "Planner", "PlannerError", "PlannerFailed", "make_planner", "planner_names",
           "PLANNERS"]

PLANNERS = ("auto", "template", "compiler", "files", "anthropic", "openai")
AUTO = ("template", "compiler")
"""`auto`: the template planner, and the compiler planner for a region it has nothing new for."""


def planner_names(spec: str) -> list[str]:
    """The names in `--planner a,b`, checked: known, none twice."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in PLANNERS]
    if not names or unknown:
        raise PlannerError(f"unknown planner {', '.join(unknown) or spec!r}: choose from {', '.join(PLANNERS)}")
    if len(set(names)) != len(names):
        raise PlannerError(f"--planner {spec!r} names a planner twice")
    if "auto" in names and set(AUTO) & set(names):
        raise PlannerError(f"--planner {spec!r}: auto is {' then '.join(AUTO)} already; name either, not both")
    return names


def make_planner(spec: str, **options) -> Planner:
    """`auto`, `template`, `compiler`, `files`, `anthropic`, `openai`, or several joined by commas. LLM planners
    need their API key; a missing key is an error, never a silent switch to another planner."""
    planners = [Fallback([_build(n, options) for n in AUTO], options.get("on_failure", lambda e: None))
                if name == "auto" else _build(name, options) for name in planner_names(spec)]
    return planners[0] if len(planners) == 1 else Combined(planners, options.get("on_failure", lambda e: None))


def _build(name: str, options: dict) -> Planner:
    # Imported on demand: the template planner's graph tools import torch, which checking a
    # command line (`agent tune --planner openai` without a key) must not wait for.
    if name == "template":
        from agent.planners.template import TemplatePlanner
        return TemplatePlanner(**options)
    if name == "compiler":
        from agent.planners.compiler import CompilerPlanner
        return CompilerPlanner(**options)
    if name == "files":
        from agent.planners.files import FilesPlanner
        return FilesPlanner(**options)
    from agent.planners.llm_client import make_client
    from agent.planners.llm import LLMPlanner
    client = make_client(name, model=options.get("llm_model"), base_url=options.get("base_url"))
    return LLMPlanner(client, **options)
