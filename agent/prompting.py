"""Where the Jinja templates live, and rendering of the LLM prompts (StrictUndefined: a
missing variable is an error, never an empty string in a prompt or a report)."""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path

import jinja2


@cache
def prompts_dir() -> Path:
    """The `prompts` folder, found through the import system (it ships as package data of a
    namespace package; importlib.resources' MultiplexedPath trips over that on Python 3.11)."""
    spec = importlib.util.find_spec("prompts")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "kernels").is_dir():
            return Path(location)
    fallback = Path(__file__).resolve().parent.parent / "prompts"
    if fallback.is_dir():
        return fallback
    raise FileNotFoundError("the prompts/ templates are not installed with this package")


def template_environment(**options) -> jinja2.Environment:
    """An environment over the `prompts` folder in which a missing variable fails the render."""
    return jinja2.Environment(loader=jinja2.FileSystemLoader(prompts_dir()), undefined=jinja2.StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, **options)


@cache
def _llm_environment() -> jinja2.Environment:
    return template_environment(autoescape=False)


def render_prompt(name: str, **context) -> str:
    return _llm_environment().get_template(name).render(**context)


def _py_literal(value) -> str:
    if isinstance(value, jinja2.Undefined):
        value._fail_with_undefined_error()
    return repr(value)


@cache
def _code_environment() -> jinja2.Environment:
    env = template_environment(autoescape=False)
    env.filters["py"] = _py_literal
    return env


def render_code(name: str, **context) -> str:
    """A generated candidate file from `prompts/kernels/<name>` (values go in as Python literals)."""
    return _code_environment().get_template(name).render(**context)
