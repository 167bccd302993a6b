"""The report's SVG charts: well-formed XML, axes and labels, and sensible for no data, one
point and many (non-finite values dropped, everything inside the picture)."""

import math
import re
import xml.etree.ElementTree as ET

import pytest

from agent.report.plots import bar_chart, fmt_tick, line_chart, nice_ticks

NS = {"s": "http://www.w3.org/2000/svg"}


def parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert not re.search(r"\b(nan|inf)\b", svg, re.I), "a non-finite number reached the picture"
    return root


def texts(root: ET.Element) -> list[str]:
    return ["".join(t.itertext()).strip() for t in root.iter("{http://www.w3.org/2000/svg}text")]


def inside(root: ET.Element) -> None:
    """Every drawn coordinate lies within the viewBox."""
    _, _, w, h = map(float, root.get("viewBox").split())
    for el in root.iter():
        for attr in ("x", "y", "x1", "x2", "y1", "y2", "cx", "cy"):
            if el.get(attr) is not None:
                limit = w if attr.startswith(("x", "cx")) else h
                assert -0.5 <= float(el.get(attr)) <= limit + 0.5, (el.tag, attr, el.get(attr))
        for pair in (el.get("points") or "").split():
            x, y = map(float, pair.split(","))
            assert 0 <= x <= w and 0 <= y <= h, pair


def line(series, **kw):
    kw = {"title": "Best <speedup> & co", "x_label": "trials", "y_label": "speedup (x)", **kw}
    return line_chart(series, **kw)


@pytest.mark.parametrize("lo,hi", [(0, 1), (0, 0.0109), (0, 3.7), (1, 1), (0, 0), (2.5e-7, 3e-7), (-3, 1234),
                                   (5, 2), (0, math.inf)])
def test_ticks_cover_the_range_in_round_steps(lo, hi):
    ticks = nice_ticks(lo, hi)
    assert 2 <= len(ticks) <= 12 and ticks == sorted(ticks)
    if math.isfinite(hi):
        assert ticks[0] <= min(lo, hi) and ticks[-1] >= max(lo, hi)
    steps = {round(b - a, 12) for a, b in zip(ticks, ticks[1:])}
    assert len(steps) == 1 or max(steps) - min(steps) < 1e-9 * max(steps)
    labels = [fmt_tick(t, ticks) for t in ticks]
    assert len(set(labels)) == len(labels), labels  # distinct: enough decimals


def test_line_chart_with_no_data_says_so():
    for series in ({}, {"RMSNorm": []}, {"RMSNorm": [(math.nan, 1.0)]}):
        root = parse(line(series, empty="no kept candidate yet"))
        assert "no kept candidate yet" in texts(root)
        assert not root.findall(".//s:polyline", NS)
        assert "trials" in texts(root) and "speedup (x)" in texts(root)
        inside(root)


def test_line_chart_with_one_point_draws_a_marker_and_extends_to_the_end():
    root = parse(line({"RMSNorm": [(3, 1.4)]}, x_end=10, ref_y=1.0, ref_label="1.0x = original"))
    (poly,) = root.findall(".//s:polyline", NS)
    assert len(poly.get("points").split()) == 2  # the point, then flat to x_end
    assert len(root.findall(".//s:circle", NS)) == 1
    assert "1.0x = original" in texts(root) and "RMSNorm" in texts(root)
    assert "Best <speedup> & co" in texts(root)  # escaped in the file, plain text once parsed
    inside(root)


def test_line_chart_with_many_points_and_series():
    pts = [(i, 1 + math.log1p(i) / 3) for i in range(1, 300)] + [(400, math.inf), (math.nan, 2)]
    root = parse(line({"A": pts, "B": [(i, 0.5 + i / 1000) for i in range(0, 500, 7)], "C": []}, x_end=500,
                      ref_y=1.0))
    polys = root.findall(".//s:polyline", NS)
    assert len(polys) == 2 and len(polys[0].get("points").split()) == 2 * 299  # a step per point, to the end
    ticks = [t for t in texts(root) if re.fullmatch(r"-?[\d.]+", t)]
    assert "0" in ticks and "500" in ticks
    inside(root)


def test_reference_far_above_the_data_is_named_not_squashing_it():
    root = parse(line({"R": [(1, 0.009), (4, 0.011)]}, ref_y=1.0, ref_label="1.0x = original"))
    assert "1.0x = original is above this range" in texts(root)
    y_ticks = [float(t.text) for t in root.iter("{http://www.w3.org/2000/svg}text") if t.get("text-anchor") == "end"
               and re.fullmatch(r"[\d.]+", t.text or "")]
    assert y_ticks and max(y_ticks) < 0.1  # the axis is scaled to the data
    inside(root)


def test_bar_chart_none_one_many():
    root = parse(bar_chart([], title="Best speedup per region", y_label="x", empty="no regions frozen"))
    assert "no regions frozen" in texts(root) and not root.findall(".//s:rect[@fill='#2da44e']", NS)
    inside(root)

    root = parse(bar_chart([("RMSNorm", 1.7)], title="t", y_label="x"))
    bars = [r for r in root.findall(".//s:rect", NS) if r.find("s:title", NS) is not None]
    assert len(bars) == 1 and float(bars[0].get("height")) > 0 and "1.70x" in texts(root)
    inside(root)

    many = [(f"Region<{i}>&", 0.5 + i / 5) for i in range(12)] + [("NotKept", None), ("Weird", math.nan)]
    root = parse(bar_chart(many, title="t", y_label="x"))
    bars = [r for r in root.findall(".//s:rect", NS) if r.find("s:title", NS) is not None]
    assert len(bars) == 12
    colors = {b.get("fill") for b in bars}
    assert len(colors) == 2  # below 1.0x and above it look different
    assert texts(root).count("none kept") == 2
    heights = [float(b.get("height")) for b in bars]
    assert heights == sorted(heights)  # taller for a bigger speedup
    inside(root)
