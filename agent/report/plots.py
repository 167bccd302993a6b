"""Small SVG charts for the report: no plotting library, no fonts, no scripts, just elements
that any browser (and GitHub's markdown preview) draws. Every function returns a complete
`<svg>` document as a string: well-formed XML, axes with ticks and labels, a readable note
instead of a blank plot when there is nothing to draw yet."""

from __future__ import annotations

import math
import re
from html import escape
from typing import TYPE_CHECKING, Mapping, Sequence

if TYPE_CHECKING:
    from agent.report.data import ReportData

PALETTE = ["#1f6feb", "#d1242f", "#1a7f37", "#9a6700", "#8250df", "#bf3989", "#0a7b83", "#57606a"]
FONT = "-apple-system, 'Segoe UI', Helvetica, Arial, sans-serif"
GOOD, BAD, INK, GRID, MUTED = "#2da44e", "#cf222e", "#24292f", "#d0d7de", "#57606a"

Point = tuple[float, float]


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]: the first is <= lo, the last >= hi, steps of
    1, 2, 2.5 or 5 times a power of ten."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        lo, hi = 0.0, 1.0
    lo, hi = min(lo, hi), max(lo, hi)
    if hi - lo < 1e-12 * max(1.0, abs(hi)):
        pad = abs(hi) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / max(1, n)
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    first = math.floor(lo / step + 1e-9) * step
    ticks = [first]
    while ticks[-1] < hi - step * 1e-9:
        ticks.append(first + len(ticks) * step)
    digits = max(0, 12 - math.floor(math.log10(step)))
    return [0.0 if abs(t) < step * 1e-9 else round(t, digits) for t in ticks]


def fmt_tick(v: float, ticks: Sequence[float]) -> str:
    step = abs(ticks[1] - ticks[0]) if len(ticks) > 1 else abs(v) or 1.0
    if max(abs(t) for t in ticks) >= 1e5 or step < 1e-4:
        return f"{v:.3g}"
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    if abs(step * 10 ** decimals - round(step * 10 ** decimals)) > 1e-6:
        decimals += 1  # 2.5, 0.25, ...
    return f"{v:.{decimals}f}"


class _Frame:
    """Maps data to pixels inside the plot area and draws the axes, grid and labels."""

    def __init__(self, width: int, height: int, xr: Sequence[float], yr: Sequence[float],
                 top: int, left: int = 64, right: int = 20, bottom: int = 52):
        self.w, self.h, self.top, self.left, self.right, self.bottom = width, height, top, left, right, bottom
        self.xt, self.yt = nice_ticks(*xr), nice_ticks(*yr)

    def x(self, v: float) -> float:
        lo, hi = self.xt[0], self.xt[-1]
        return round(self.left + (v - lo) / (hi - lo) * (self.w - self.left - self.right), 2)

    def y(self, v: float) -> float:
        lo, hi = self.yt[0], self.yt[-1]
        return round(self.h - self.bottom - (v - lo) / (hi - lo) * (self.h - self.top - self.bottom), 2)

    def axes(self, x_label: str, y_label: str, x_ticks: bool = True) -> list[str]:
        x0, x1, y0, y1 = self.left, self.w - self.right, self.h - self.bottom, self.top
        out = []
        for t in self.yt:
            y = self.y(t)
            out.append(f'<line x1="{x0}" y1="{y}" x2="{x1}" y2="{y}" stroke="{GRID}" stroke-width="1"/>')
            out.append(f'<text x="{x0 - 6}" y="{y + 4}" text-anchor="end" fill="{MUTED}">{fmt_tick(t, self.yt)}</text>')
        if x_ticks:
            for t in self.xt:
                x = self.x(t)
                out.append(f'<line x1="{x}" y1="{y0}" x2="{x}" y2="{y0 + 5}" stroke="{INK}" stroke-width="1"/>')
                out.append(f'<text x="{x}" y="{y0 + 18}" text-anchor="middle" fill="{MUTED}">'
                           f'{fmt_tick(t, self.xt)}</text>')
        out.append(f'<line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y0}" stroke="{INK}" stroke-width="1.2"/>')
        out.append(f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y1}" stroke="{INK}" stroke-width="1.2"/>')
        out.append(f'<text x="{(x0 + x1) / 2}" y="{self.h - 10}" text-anchor="middle" fill="{INK}">{escape(x_label)}</text>')
        cy = (y0 + y1) / 2
        out.append(f'<text x="16" y="{cy}" text-anchor="middle" fill="{INK}" '
                   f'transform="rotate(-90 16 {cy})">{escape(y_label)}</text>')
        return out

    def ref_line(self, value: float | None, label: str) -> list[str]:
        if value is not None and value > self.yt[-1]:
            return [f'<text x="{self.w - self.right - 4}" y="{self.top + 12}" text-anchor="end" fill="{MUTED}">'
                    f'{escape(label)} is above this range</text>']
        if value is None or not (self.yt[0] <= value <= self.yt[-1]):
            return []
        y = self.y(value)
        return [f'<line x1="{self.left}" y1="{y}" x2="{self.w - self.right}" y2="{y}" stroke="{INK}" '
                f'stroke-width="1" stroke-dasharray="5 4"/>',
                f'<text x="{self.w - self.right - 4}" y="{y - 5}" text-anchor="end" fill="{INK}">{escape(label)}</text>']

    def note(self, text: str) -> str:
        return (f'<text x="{(self.left + self.w - self.right) / 2}" y="{(self.top + self.h - self.bottom) / 2}" '
                f'text-anchor="middle" fill="{MUTED}" font-size="14">{escape(text)}</text>')


_LONG_COORDINATE = re.compile(r'(?<=[a-z]=")(-?\d+\.\d{3,})(?=")')


def _svg(width: int, height: int, title: str, body: list[str]) -> str:
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
            f'height="{height}" role="img" aria-label="{escape(title)}" font-family="{escape(FONT)}" font-size="12">')
    text = "\n".join([head, f"<title>{escape(title)}</title>",
                      f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
                      f'<text x="{width / 2}" y="20" text-anchor="middle" fill="{INK}" font-size="14" '
                      f'font-weight="600">{escape(title)}</text>', *body, "</svg>"]) + "\n"
    # Coordinates to two decimals: 129.32999999999998 is float noise, not precision.
    return _LONG_COORDINATE.sub(lambda m: f"{float(m.group(1)):.2f}", text)


def _legend(names: Sequence[str], width: int, left: int) -> tuple[list[str], int]:
    """Legend entries laid out in rows under the title; returns the elements and the height used."""
    out, x, y = [], left, 40
    for i, name in enumerate(names):
        w = 30 + 7 * len(name)
        if x + w > width - 10 and x > left:
            x, y = left, y + 18
        color = PALETTE[i % len(PALETTE)]
        out.append(f'<line x1="{x}" y1="{y - 4}" x2="{x + 18}" y2="{y - 4}" stroke="{color}" stroke-width="3"/>')
        out.append(f'<text x="{x + 24}" y="{y}" fill="{INK}">{escape(name)}</text>')
        x += w + 14
    return out, (y - 40 + 18 if names else 0)


def _finite(points: Sequence[Point]) -> list[Point]:
    return sorted((float(x), float(y)) for x, y in points if math.isfinite(x) and math.isfinite(y))


def line_chart(series: Mapping[str, Sequence[Point]], *, title: str, x_label: str, y_label: str,
               step: bool = True, x_end: float | None = None, ref_y: float | None = None,
               ref_label: str = "", x_min: float | None = 0.0, y_min: float | None = 0.0,
               width: int = 500, height: int = 320, empty: str = "no data yet") -> str:
    """One polyline per series. `step`: a best-so-far curve, flat from each point to the next
    (and on to `x_end`, the end of the search). Points are marked; non-finite ones dropped."""
    data = {name: _finite(pts) for name, pts in series.items()}
    xs = [x for pts in data.values() for x, _ in pts] + ([x_end] if x_end is not None and math.isfinite(x_end) else [])
    ys = [y for pts in data.values() for _, y in pts]
    if ref_y is not None and (not ys or max(ys) >= ref_y / 4):  # far below the line: show the data's shape
        ys.append(ref_y)
    legend, legend_h = _legend(list(data), width, 64)
    if not xs:
        xs = [0.0, 1.0]
    if not ys:
        ys = [0.0, 1.0]
    xr = (min(xs + ([x_min] if x_min is not None else [])), max(xs))
    yr = (min(ys + ([y_min] if y_min is not None else [])), max(ys) * 1.05 if max(ys) > 0 else max(ys))
    f = _Frame(width, height, xr, yr, top=36 + legend_h)
    body = f.axes(x_label, y_label) + f.ref_line(ref_y, ref_label) + legend
    if not any(data.values()):
        body.append(f.note(empty))
    end = max(xs) if x_end is None else x_end
    for i, (name, pts) in enumerate(data.items()):
        if not pts:
            continue
        color = PALETTE[i % len(PALETTE)]
        path: list[Point] = []
        for x, y in pts:
            if step and path:
                path.append((x, path[-1][1]))
            path.append((x, y))
        if step and end > path[-1][0]:
            path.append((end, path[-1][1]))
        coords = " ".join(f"{f.x(x)},{f.y(y)}" for x, y in path)
        body.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2" '
                    f'stroke-linejoin="round"><title>{escape(name)}</title></polyline>')
        for x, y in pts[-200:]:
            body.append(f'<circle cx="{f.x(x)}" cy="{f.y(y)}" r="3" fill="{color}">'
                        f'<title>{escape(name)}: {y:.3g} at {x:.4g}</title></circle>')
    return _svg(width, height, title, body)


def bar_chart(bars: Sequence[tuple[str, float | None]], *, title: str, y_label: str, ref_y: float | None = 1.0,
              ref_label: str = "1.0x = original", value_suffix: str = "x", height: int = 300,
              empty: str = "nothing to show yet") -> str:
    """One vertical bar per label; green above `ref_y`, red below; None: no bar, a note."""
    n = len(bars)
    width = max(360, min(960, 84 + 96 * n))
    vals = [v for _, v in bars if v is not None and math.isfinite(v)]
    hi = max(vals + ([ref_y] if ref_y is not None and (not vals or max(vals) >= ref_y / 4) else []) + [0.0])
    f = _Frame(width, height, (0.0, hi * 1.1 if hi > 0 else 1.0), (0.0, hi * 1.1 if hi > 0 else 1.0),
               top=36, bottom=58)
    f.xt = [0.0, float(max(n, 1))]
    body = f.axes("", y_label, x_ticks=False) + f.ref_line(ref_y, ref_label)
    if not n:
        body.append(f.note(empty))
    slot = (width - f.left - f.right) / max(n, 1)
    base = f.y(0.0)
    for i, (label, v) in enumerate(bars):
        cx = f.left + slot * (i + 0.5)
        short = label if len(label) <= 14 else label[:13] + "…"
        body.append(f'<text x="{cx:.2f}" y="{f.h - f.bottom + 16}" text-anchor="middle" fill="{INK}">'
                    f'<title>{escape(label)}</title>{escape(short)}</text>')
        if v is None or not math.isfinite(v):
            body.append(f'<text x="{cx:.2f}" y="{base - 8}" text-anchor="middle" fill="{MUTED}">none kept</text>')
            continue
        top, bw = f.y(v), min(56.0, slot * 0.6)
        color = GOOD if ref_y is None or v >= ref_y else BAD
        body.append(f'<rect x="{cx - bw / 2:.2f}" y="{top}" width="{bw:.2f}" height="{max(0.0, base - top):.2f}" '
                    f'fill="{color}"><title>{escape(label)}: {v:.3g}{escape(value_suffix)}</title></rect>')
        body.append(f'<text x="{cx:.2f}" y="{top - 5:.2f}" text-anchor="middle" fill="{INK}">'
                    f'{v:.2f}{escape(value_suffix)}</text>')
    return _svg(width, height, title, body)


def plots(data: "ReportData") -> dict[str, str]:
    """The report's images as SVG: best speedup so far against trials and against device
    time, and the best speedup per region."""
    by_trial, by_time = data.progress()
    total = data.gpu_seconds
    unit, div = (("s", 1.0) if total < 120 else ("min", 60.0) if total < 7200 else ("hours", 3600.0))
    dev = "CPU time" if data.cpu_only else "GPU time"
    kind = " (CPU timings)" if data.cpu_only else ""
    several = any(len(r.best.speedups()) > 1 for r in data.regions if r.best)
    bars = [(f"{r.name} · {g}", s) for r in data.regions if r.best for g, s in sorted(r.best.speedups().items())] \
        if several else [(r.name, r.score) for r in data.regions]
    bars += [(r.name, None) for r in data.regions if several and not r.best]
    return {
        "progress-trials": line_chart(by_trial, title=f"Best kept speedup vs trials{kind}", x_label="trials finished",
                                      y_label="best speedup (x)", x_end=len(data.history.trials), ref_y=1.0,
                                      ref_label="1.0x = original", empty="no kept candidate yet"),
        "progress-time": line_chart({k: [(x / div, y) for x, y in v] for k, v in by_time.items()},
                                    title=f"Best kept speedup vs {dev}{kind}", x_label=f"cumulative {dev}, {unit}",
                                    y_label="best speedup (x)", x_end=total / div, ref_y=1.0,
                                    ref_label="1.0x = original", empty="no kept candidate yet"),
        "regions": bar_chart(bars, title=f"Best speedup per region{kind}",
                             y_label="best speedup (x)", empty="no regions frozen"),
    }
