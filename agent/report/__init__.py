"""The morning report: `runs/<run>/report.md` and a self-contained `runs/<run>/report.html`.

Summary first (end-to-end speedup per workload and device generation with its error against
the tolerance, from integration.json when integration has run; GPU-hours, LLM dollars, trials
run and kept; where the tuner stands against eager and torch.compile; why a planner stopped),
then the search-progress plots, then per region the best kept candidate (times per workload,
speedup per generation, error against the tolerance, who found it, its diff against the
original forward) and what was rejected and why. Built from the store opened read-only, so it
can be rebuilt mid-run.

    data.py      what the report shows, read from the run folder (`collect`)
    numbers.py   formatting shared by both renderings
    markdown.py  report.md        html.py  report.html        plots.py  the SVG charts
"""

from __future__ import annotations

import os
from pathlib import Path

from agent.report.data import ReportData, collect
from agent.report.html import render_html
from agent.report.markdown import render_md
from agent.report.plots import plots
from tools.runfolder import RunFolder

__all__ = ["ReportData", "collect", "render_html", "render_md", "write", "write_html"]


def _write(path: Path, text: str) -> Path:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def write_html(run: RunFolder, data: ReportData | None = None) -> Path:
    return _write(run.path / "report.html", render_html(data or collect(run)))


def write(run: RunFolder) -> Path:
    """report.md (with its plots as SVG files beside it) and report.html; returns report.md."""
    data = collect(run)
    images = {}
    for name, svg in plots(data).items():
        images[name] = _write(run.path / f"report-{name}.svg", svg).name
    write_html(run, data)
    return _write(run.path / "report.md", render_md(data, images))
