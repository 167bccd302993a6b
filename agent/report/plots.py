"""The report's charts, drawn by matplotlib as SVG documents that report.html inlines and report.md
links beside it. matplotlib is imported only here, when a report is written: figures are made
without pyplot and saved by the SVG backend, so nothing needs a display.

Text stays text (`svg.fonttype: none`), so a browser draws it and a test can read it. Each
chart's element ids carry its name, so three charts inlined in one page never share an id."""

from __future__ import annotations

import io
import math
import re
from html import escape
from typing import TYPE_CHECKING, Mapping, Sequence

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from agent.report.data import ReportData

PALETTE = ["#1f6feb", "#d1242f", "#1a7f37", "#9a6700", "#8250df", "#bf3989", "#0a7b83", "#57606a"]
GOOD, BAD, INK, MUTED = "#2da44e", "#cf222e", "#24292f", "#57606a"
STYLE = {"svg.fonttype": "none", "svg.hashsalt": "nightshift", "font.size": 9, "text.parse_math": False,
         "axes.axisbelow": True, "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "axes.grid.axis": "y",
         "grid.color": "#d0d7de", "axes.edgecolor": INK, "text.color": INK, "axes.labelcolor": INK,
         "xtick.color": MUTED, "ytick.color": MUTED}
NO_METADATA = {"Creator": None, "Date": None, "Format": None, "Type": None}

Point = tuple[float, float]


def _finite(points: Sequence[Point]) -> list[Point]:
    return sorted((float(x), float(y)) for x, y in points if math.isfinite(x) and math.isfinite(y))


def _figure(width: float, height: float) -> "Figure":
    from matplotlib.figure import Figure
    return Figure(figsize=(width, height), layout="constrained")


def _y_range(ys: list[float], ref_y: float | None) -> tuple[float, float, bool]:
    """(bottom, top, reference above it): the reference line is in range unless it would squash
    data far below it to the floor (then the top leaves room for the note that says so)."""
    above = ref_y is not None and bool(ys) and max(ys) < ref_y / 4
    ys = ys + ([ref_y] if ref_y is not None and not above else []) or [1.0]
    top = max(ys) * (1.2 if above else 1.05) if max(ys) > 0 else 1.0
    return min(0.0, *ys), top, above


def _reference(ax, ref_y: float | None, label: str, above: bool) -> None:
    if above:
        ax.text(0.99, 0.97, f"{label} is above this range", transform=ax.transAxes, ha="right", va="top",
                color=MUTED)
    elif ref_y is not None:
        ax.axhline(ref_y, color=INK, linewidth=1, linestyle=(0, (5, 4)))
        ax.text(0.99, ref_y, label, transform=ax.get_yaxis_transform(), ha="right", va="bottom")


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color=MUTED, fontsize=11)


def line_figure(series: Mapping[str, Sequence[Point]], *, title: str, x_label: str, y_label: str,
                x_end: float | None = None, ref_y: float | None = None, ref_label: str = "",
                empty: str = "no data yet") -> "Figure":
    """A best-so-far curve per series: flat from each point to the next and on to `x_end` (the
    end of the search), points marked (the last 200), non-finite ones dropped."""
    data = {name: _finite(pts) for name, pts in series.items()}
    xs = [x for pts in data.values() for x, _ in pts] + ([x_end] if x_end is not None and math.isfinite(x_end) else [])
    bottom, top, above = _y_range([y for pts in data.values() for _, y in pts], ref_y)
    fig = _figure(6.4, 4.0)
    ax = fig.add_subplot()
    end = max(xs, default=1.0)
    ax.set(title=title, xlabel=x_label, ylabel=y_label, xlim=(min(0.0, *xs) if xs else 0.0, end if end > 0 else 1.0),
           ylim=(bottom, top))
    _reference(ax, ref_y, ref_label, above)
    if not any(data.values()):
        _note(ax, empty)
    for i, (name, pts) in enumerate(data.items()):
        if not pts:
            continue
        path: list[Point] = []
        for x, y in pts:
            if path:
                path.append((x, path[-1][1]))
            path.append((x, y))
        if end > path[-1][0]:
            path.append((end, path[-1][1]))
        color = PALETTE[i % len(PALETTE)]
        ax.plot(*zip(*path), color=color, linewidth=2, label=name, gid=f"series-{i}")
        ax.plot(*zip(*pts[-200:]), "o", color=color, markersize=4, label=f"_{name} points")
    if any(data.values()):
        ax.legend(loc="lower right", frameon=False)
    return fig


def bar_figure(bars: Sequence[tuple[str, float | None]], *, title: str, y_label: str, ref_y: float | None = 1.0,
               ref_label: str = "1.0x = original", value_suffix: str = "x",
               empty: str = "nothing to show yet") -> "Figure":
    """One bar per label, green at or above `ref_y` and red below; None: no bar, a note."""
    values = [v if v is not None and math.isfinite(v) else None for _, v in bars]
    bottom, top, above = _y_range([v for v in values if v is not None], ref_y)
    fig = _figure(max(3.6, min(9.6, 0.84 + 0.96 * len(bars))), 3.8)
    ax = fig.add_subplot()
    ax.set(title=title, ylabel=y_label, ylim=(bottom, top * 1.05), xlim=(-0.6, max(len(bars), 1) - 0.4))
    _reference(ax, ref_y, ref_label, above)
    if not bars:
        _note(ax, empty)
    drawn = [(i, v) for i, v in enumerate(values) if v is not None]
    if drawn:
        rects = ax.bar([i for i, _ in drawn], [v for _, v in drawn], width=0.6, gid="bars",
                       color=[GOOD if ref_y is None or v >= ref_y else BAD for _, v in drawn])
        ax.bar_label(rects, labels=[f"{v:.2f}{value_suffix}" for _, v in drawn], padding=2)
    for i, v in enumerate(values):
        if v is None:
            ax.text(i, 0, "none kept", ha="center", va="bottom", color=MUTED)
    ax.set_xticks(range(len(bars)), [label if len(label) <= 14 else label[:13] + "…" for label, _ in bars],
                  rotation=30 if len(bars) > 4 else 0, ha="right" if len(bars) > 4 else "center")
    return fig


_ID = re.compile(r'(\bid="|href="#|url\(#)')
_TAG = re.compile(r"<[^>]+>")
_LONG_COORDINATE = re.compile(r"(?<![\w.])(-?\d+\.\d{3,})")


def to_svg(fig: "Figure", name: str, title: str) -> str:
    """The figure as an `<svg>` element (no XML prolog, so it can be inlined), its ids prefixed
    with `name`, labelled with `title` for screen readers."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata=NO_METADATA)
    text = buf.getvalue()
    text = _ID.sub(lambda m: f"{m.group(1)}{name}-", text[text.index("<svg"):])
    # Coordinates to two decimals (a hundredth of a point); the text between tags is left as drawn.
    text = _TAG.sub(lambda tag: _LONG_COORDINATE.sub(lambda m: f"{float(m.group()):.2f}", tag.group()), text)
    return text.replace("<svg ", f'<svg role="img" aria-label="{escape(title)}" ', 1)


def line_chart(series: Mapping[str, Sequence[Point]], *, name: str = "chart", title: str, **kw) -> str:
    import matplotlib
    with matplotlib.rc_context(STYLE):
        return to_svg(line_figure(series, title=title, **kw), name, title)


def bar_chart(bars: Sequence[tuple[str, float | None]], *, name: str = "chart", title: str, **kw) -> str:
    import matplotlib
    with matplotlib.rc_context(STYLE):
        return to_svg(bar_figure(bars, title=title, **kw), name, title)


def plots(data: "ReportData") -> dict[str, tuple[str, str]]:
    """The report's charts, name -> (title, SVG): best speedup so far against trials and against
    device time, and the best speedup per region."""
    by_trial, by_time = data.progress()
    total = data.gpu_seconds
    unit, div = (("s", 1.0) if total < 120 else ("min", 60.0) if total < 7200 else ("hours", 3600.0))
    dev = "CPU time" if data.cpu_only else "GPU time"
    kind = " (CPU timings)" if data.cpu_only else ""
    several = any(len(r.best.speedups()) > 1 for r in data.regions if r.best)
    bars = [(f"{r.name} · {g}", s) for r in data.regions if r.best for g, s in sorted(r.best.speedups().items())] \
        if several else [(r.name, r.score) for r in data.regions]
    bars += [(r.name, None) for r in data.regions if several and not r.best]
    line = dict(y_label="best speedup (x)", ref_y=1.0, ref_label="1.0x = original", empty="no kept candidate yet")
    titles = {"progress-trials": f"Best kept speedup vs trials{kind}",
              "progress-time": f"Best kept speedup vs {dev}{kind}", "regions": f"Best speedup per region{kind}"}
    svgs = {"progress-trials": line_chart(by_trial, name="progress-trials", title=titles["progress-trials"],
                                          x_label="trials finished", x_end=len(data.history.trials), **line),
            "progress-time": line_chart({k: [(x / div, y) for x, y in v] for k, v in by_time.items()},
                                        name="progress-time", title=titles["progress-time"],
                                        x_label=f"cumulative {dev}, {unit}", x_end=total / div, **line),
            "regions": bar_chart(bars, name="regions", title=titles["regions"], y_label="best speedup (x)",
                                 empty="no regions frozen")}
    return {name: (titles[name], svg) for name, svg in svgs.items()}
