"""report.md and report.html from one `ReportView`, through prompts/report/*.j2 (StrictUndefined:
a field a template names and the view lacks fails the render). The HTML template escapes
everything it is given; only the highlighted source lines and the charts' SVG go in as markup."""

from __future__ import annotations

from functools import cache, lru_cache
from html import escape

import jinja2
from markupsafe import Markup
from pygments.lexers import PythonLexer
from pygments.styles import get_style_by_name

from agent.prompting import template_environment
from agent.report.view import ReportView

STYLE = get_style_by_name("default")


@lru_cache(maxsize=None)
def _css(ttype) -> str:
    s = STYLE.style_for_token(ttype)
    parts = [f"color:#{s['color']}"] if s["color"] else []
    parts += ["font-weight:bold"] if s["bold"] else []
    parts += ["font-style:italic"] if s["italic"] else []
    return ";".join(parts)


def highlight_lines(source: str) -> list[Markup]:
    """Python source as HTML, one string per line, with inline-styled spans (a token that
    spans lines, like a docstring, is split at the line ends)."""
    source = source.removesuffix("\n")
    lines: list[list[str]] = [[]]
    for ttype, text in PythonLexer(stripnl=False, ensurenl=False).get_tokens(source):
        for k, part in enumerate(text.split("\n")):
            if k:
                lines.append([])
            if part:
                css = _css(ttype)
                lines[-1].append(f'<span style="{css}">{escape(part)}</span>' if css else escape(part))
    html = ["".join(parts) for parts in lines]
    want = source.split("\n")
    return [Markup(line) for line in (html if len(html) == len(want) else map(escape, want))]


@cache
def _environment() -> jinja2.Environment:
    env = template_environment(autoescape=jinja2.select_autoescape(enabled_extensions=("html.j2",),
                                                                   default_for_string=False))
    env.globals["highlight_lines"] = highlight_lines
    env.filters["markup"] = Markup
    return env


def render_md(view: ReportView) -> str:
    return _environment().get_template("report/report.md.j2").render(v=view)


def render_html(view: ReportView) -> str:
    """One self-contained page: inline stylesheet, inline SVG, nothing fetched from anywhere."""
    return _environment().get_template("report/report.html.j2").render(v=view)


def render_named(name: str, **context) -> str:
    """Any template of prompts/ through the report's environment (the corpus report's)."""
    return _environment().get_template(name).render(**context)
