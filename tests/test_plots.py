"""The report's charts (matplotlib's SVG): well-formed XML whose text a browser draws and a reader
can find, ids that stay unique when the three charts share report.html, nothing fetched, the same
file when rebuilt, and sensible for no data, one point and many (non-finite values dropped,
everything inside the picture)."""

import math
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import matplotlib
import pytest

from agent.report.plots import STYLE, bar_chart, bar_figure, line_chart, line_figure, to_svg

ROOT = Path(__file__).resolve().parent.parent
SVG = "{http://www.w3.org/2000/svg}"


def parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    assert not re.search(r"\b(nan|inf)\b", svg, re.I), "a non-finite number reached the picture"
    assert not re.search(r'href="(?!#)', svg), "the chart refers to something outside itself"
    return root


def texts(root: ET.Element) -> list[str]:
    return ["".join(t.itertext()).strip() for t in root.iter(f"{SVG}text")]


def y_tick_labels(root: ET.Element) -> list[str]:
    (axis,) = [g for g in root.iter(f"{SVG}g") if g.get("id", "").endswith("matplotlib.axis_2")]
    return [t for t in texts(axis) if t]


def inside(root: ET.Element, ax) -> None:
    """Every text and marker lies within the viewBox, every data point within the axes."""
    _, _, w, h = map(float, root.get("viewBox").split())
    for el in root.iter():
        if el.tag in (f"{SVG}text", f"{SVG}use"):  # placed by x and y, or (rotated) by a translate
            at = re.match(r"translate\(([-\d.]+) ([-\d.]+)\)", el.get("transform", ""))
            x, y = map(float, at.groups() if at else (el.get("x"), el.get("y")))
            assert -0.5 <= x <= w + 0.5 and -0.5 <= y <= h + 0.5, el.attrib
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    for line in ax.get_lines():
        if line.get_transform() is ax.transData:  # not the reference line, which spans the axes
            assert all(x0 <= x <= x1 and y0 <= y <= y1 for x, y in line.get_xydata()), line.get_label()
    for bar in ax.patches:
        assert x0 <= bar.get_x() and bar.get_x() + bar.get_width() <= x1 and y0 <= bar.get_height() <= y1


def draw(make, *args, **kw):
    """(axes, parsed SVG) of one chart, drawn the way line_chart and bar_chart draw it."""
    with matplotlib.rc_context(STYLE):
        fig = make(*args, **kw)
        svg = to_svg(fig, "t", kw["title"])
    return fig.axes[0], parse(svg)


def line(series, **kw):
    return draw(line_figure, series, **{"title": "Best <speedup> & co", "x_label": "trials",
                                        "y_label": "speedup (x)", **kw})


def series_lines(ax) -> list:
    return [ln for ln in ax.get_lines() if (ln.get_gid() or "").startswith("series-")]


def markers(ax) -> list:
    return [ln for ln in ax.get_lines() if ln.get_label().endswith(" points")]


def test_line_chart_with_no_data_says_so():
    for series in ({}, {"RMSNorm": []}, {"RMSNorm": [(math.nan, 1.0)]}):
        ax, root = line(series, empty="no kept candidate yet")
        assert "no kept candidate yet" in texts(root)
        assert not series_lines(ax) and not markers(ax)
        assert "trials" in texts(root) and "speedup (x)" in texts(root)
        inside(root, ax)


def test_line_chart_with_one_point_draws_a_marker_and_extends_to_the_end():
    ax, root = line({"RMSNorm": [(3, 1.4)]}, x_end=10, ref_y=1.0, ref_label="1.0x = original")
    (curve,) = series_lines(ax)
    assert curve.get_xydata().tolist() == [[3, 1.4], [10, 1.4]]  # the point, then flat to x_end
    (dots,) = markers(ax)
    assert dots.get_xydata().tolist() == [[3, 1.4]]
    assert root.find(f".//{SVG}g[@id='t-series-0']/{SVG}path") is not None  # the curve is drawn
    assert "1.0x = original" in texts(root) and "RMSNorm" in texts(root)
    assert "Best <speedup> & co" in texts(root)  # escaped in the file, plain text once parsed
    inside(root, ax)


def test_line_chart_with_many_points_and_series():
    pts = [(i, 1 + math.log1p(i) / 3) for i in range(1, 300)] + [(400, math.inf), (math.nan, 2)]
    ax, root = line({"A": pts, "B": [(i, 0.5 + i / 1000) for i in range(0, 500, 7)], "C": []}, x_end=500, ref_y=1.0)
    curves = series_lines(ax)
    assert len(curves) == 2 and len(curves[0].get_xydata()) == 2 * 299  # a step per point, to the end
    assert len(markers(ax)[0].get_xydata()) == 200  # the last 200 points are marked
    assert "0" in texts(root) and "500" in texts(root)
    inside(root, ax)


@pytest.mark.parametrize("lo,hi", [(0, 1), (0, 0.0109), (0, 3.7), (1, 1), (0, 0), (2.5e-7, 3e-7), (5, 2),
                                   (0, math.inf)])
def test_the_y_axis_covers_the_data_with_distinct_labels(lo, hi):
    ax, root = line({"R": [(1, lo), (2, hi)]})
    finite = [v for v in (lo, hi) if math.isfinite(v)]
    assert ax.get_ylim()[0] <= min(finite) and ax.get_ylim()[1] >= max(finite)
    labels = y_tick_labels(root)
    assert len(labels) >= 2 and len(set(labels)) == len(labels), labels  # enough decimals to tell them apart
    inside(root, ax)


def test_reference_far_above_the_data_is_named_not_squashing_it():
    ax, root = line({"R": [(1, 0.009), (4, 0.011)]}, ref_y=1.0, ref_label="1.0x = original")
    assert "1.0x = original is above this range" in texts(root)
    assert ax.get_ylim()[1] < 0.1  # the axis is scaled to the data
    inside(root, ax)


def test_bar_chart_none_one_many():
    ax, root = draw(bar_figure, [], title="Best speedup per region", y_label="x", empty="no regions frozen")
    assert "no regions frozen" in texts(root) and not ax.patches
    inside(root, ax)

    ax, root = draw(bar_figure, [("RMSNorm", 1.7)], title="t", y_label="x")
    (bar,) = ax.patches
    assert bar.get_height() == pytest.approx(1.7) and "1.70x" in texts(root) and "RMSNorm" in texts(root)
    inside(root, ax)

    many = [(f"Region<{i}>&", 0.5 + i / 5) for i in range(12)] + [("NotKept", None), ("Weird", math.nan)]
    ax, root = draw(bar_figure, many, title="t", y_label="x")
    assert len(ax.patches) == 12
    assert len({bar.get_facecolor() for bar in ax.patches}) == 2  # below 1.0x and above it look different
    assert texts(root).count("none kept") == 2 and "Region<3>&" in texts(root)
    heights = [bar.get_height() for bar in ax.patches]
    assert heights == sorted(heights)  # taller for a bigger speedup
    inside(root, ax)


def test_charts_inlined_in_one_page_share_no_id_and_rebuild_the_same():
    first = line_chart({"R": [(1, 1.2)]}, name="a", title="t", x_label="x", y_label="y", ref_y=1.0)
    second = bar_chart([("R", 1.2)], name="b", title="t", y_label="y")
    ids = [re.findall(r'\bid="([^"]+)"', svg) for svg in (first, second)]
    assert all(i.startswith("a-") for i in ids[0]) and all(i.startswith("b-") for i in ids[1])
    for svg, own in zip((first, second), ids):
        assert set(re.findall(r'(?:href="#|url\(#)([^")]+)', svg)) <= set(own)  # every reference is its own
    assert line_chart({"R": [(1, 1.2)]}, name="a", title="t", x_label="x", y_label="y", ref_y=1.0) == first


def test_matplotlib_is_imported_only_to_draw_a_report():
    code = "import sys, agent.cli.main, agent.report; assert 'matplotlib' not in sys.modules, 'imported eagerly'"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
