"""The morning report: `runs/<run>/report.md` and a self-contained `runs/<run>/report.html`.

Summary first (end-to-end speedup per workload and device generation with its error against
the tolerance, from integration.json when integration has run; GPU-hours, LLM dollars, trials
run and kept; where the tuner stands against eager and torch.compile; why a planner stopped),
then the search-progress plots, then per region the best kept candidate (times per workload,
speedup per generation, error against the tolerance, who found it, its diff against the
original forward) and what was rejected and why. Built from the store opened read-only, so it
can be rebuilt mid-run.

    data.py      what the run holds, read from its folder (`collect`)
    view.py      what the report says, as text, built once (`build`)
    render.py    report.md and report.html from that one view, through prompts/report/*.j2
    numbers.py   formatting        plots.py  the charts (matplotlib's SVG)
"""

from __future__ import annotations

import os
from pathlib import Path

from agent.report.data import ReportData, collect
from agent.report.render import render_html, render_md
from agent.report.view import ReportView, build
from tools.runfolder import RunFolder

__all__ = ["ReportData", "ReportView", "build", "collect", "render_html", "render_md", "write", "write_html"]


def _write(path: Path, text: str) -> Path:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def write_html(run: RunFolder, data: ReportData | None = None) -> Path:
    return _write(run.path / "report.html", render_html(build(data or collect(run))))


def write(run: RunFolder) -> Path:
    """report.md (with its charts as SVG files beside it) and report.html; returns report.md."""
    view = build(collect(run))
    for chart in view.charts:
        _write(run.path / chart.file, chart.svg)
    _write(run.path / "report.html", render_html(view))
    return _write(run.path / "report.md", render_md(view))
