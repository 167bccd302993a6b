"""The screen: a verified candidate whose first timed round reads clearly slower than its
region's best so far is not timed further.

Every full timing starts with the same round (the original and the candidate side by side, the
A/A control beside them; sandbox/timed.py). With a bar, the tuner reads that round of every
workload before any other, and drops the candidate only when it is slower than the best by more
than SCREEN_MARGIN and by more than both noise bands together, overall and on every workload (a
candidate slower overall may still win a workload, where integration's dispatcher would route
it). A dropped candidate's trial is `screened`: verified like any other, never ranked, and what
the screen read is kept as its record, never as a timing.

How often the screen drops a candidate that full timing would rank first is measured, not
assumed: a random share of the candidates it would drop (AUDIT_SHARE, drawn by the tuner) is
timed in full anyway, and `misses` counts those that beat the best they were screened against.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

SCREEN_MARGIN = 1.5
"""A candidate is dropped only when the best is more than this many times faster (Inductor's
max-autotune stops at 2x the best so far); the two noise bands widen it, never narrow it."""
AUDIT_SHARE = 0.1
"""Of the candidates the screen would drop, the share timed in full anyway to measure its misses."""


@dataclass(frozen=True)
class ScreenBar:
    """A region's best so far on one generation, as the screen compares with it."""

    best: str
    """The best candidate's hash."""
    speedup: float
    band: float
    workloads: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Workload -> (the best speedup any kept candidate reached there, that timing's band)."""
    audit: bool = False
    """Timed in full even where the screen would drop it (its record says so)."""


def bar(trials: Iterable[Any], best_hash: str | None = None, audit: bool = False) -> ScreenBar | None:
    """The bar of ranked trials of one region on one generation (`Trial`s): the best by speedup
    (or `best_hash`'s), and per workload the best any of them reached. None without one."""
    ranked = [t for t in trials if t.ranked]
    if not ranked:
        return None
    top = next((t for t in ranked if t.candidate_hash == best_hash), None) or max(ranked, key=lambda t: t.speedup)
    per: dict[str, tuple[float, float]] = {}
    for t in ranked:
        for w in t.timings:
            if w.workload not in per or w.speedup > per[w.workload][0]:
                per[w.workload] = (w.speedup, w.noise_band)
    return ScreenBar(top.candidate_hash, top.speedup, top.noise_band or 0.0, per, audit)


def verdict(screen: ScreenBar, weights: dict[str, float], first: list[Any]) -> dict | None:
    """None for a contender; else the screen's record of a candidate it drops: the best it was
    compared with, how many times faster the best read (overall and per workload), and the margins.
    `first`: the first round of each workload (`WorkloadTiming`s), `weights`: the problem's."""
    if not first:
        return None
    base = sum(weights.get(t.workload, 1.0) * t.baseline_ms for t in first)
    cand = sum(weights.get(t.workload, 1.0) * t.candidate_ms for t in first)
    if base <= 0 or cand <= 0:
        return None
    band = sum(weights.get(t.workload, 1.0) * t.baseline_ms * _band(t) for t in first) / base
    ratios = {"overall": (screen.speedup / (base / cand), _margin(band, screen.band))}
    for t in first:
        if t.workload not in screen.workloads or t.speedup <= 0:
            return None  # nothing to compare with there: a contender
        best, best_band = screen.workloads[t.workload]
        ratios[t.workload] = (best / t.speedup, _margin(_band(t), best_band))
    if any(ratio <= margin for ratio, margin in ratios.values()):
        return None
    return {"best": screen.best, "best_speedup": round(screen.speedup, 4),
            "ratio": {k: round(r, 3) for k, (r, _) in ratios.items()},
            "margin": {k: round(m, 3) for k, (_, m) in ratios.items()},
            "best_by_workload": {w: round(s, 4) for w, (s, _) in screen.workloads.items()},
            "audited": screen.audit}


def _band(t: Any) -> float:
    """One round's noise: its A/A band (one round gives at least the 5% default) and each side's
    spread over its repetitions."""
    return max(t.noise_band, t.baseline_spread, t.candidate_spread)


def _margin(band: float, best_band: float) -> float:
    return max(SCREEN_MARGIN, (1 + band) * (1 + best_band))


def misses(trials: Iterable[Any]) -> tuple[int, int, int]:
    """(screened out, audited: would have been screened out but timed in full, audited ones that
    full timing ranked above the best they were screened against, overall or on a workload)."""
    dropped = audited = missed = 0
    for t in trials:
        rec = getattr(t, "screen", None)
        if not rec:
            continue
        if not rec.get("audited"):
            dropped += t.status.value == "screened"
            continue
        audited += 1
        beat = t.ranked and t.speedup >= rec.get("best_speedup", float("inf"))
        by = rec.get("best_by_workload") or {}
        beat = beat or (t.ranked and any(w.speedup >= by.get(w.workload, float("inf")) for w in t.timings))
        missed += bool(beat)
    return dropped, audited, missed


def summary(trials: Iterable[Any]) -> str:
    """One line on the screen's work and its measured misses ('' when it dropped nothing)."""
    dropped, audited, missed = misses(trials)
    if not dropped and not audited:
        return ""
    rate = f" ({missed / audited:.0%})" if audited else ""
    return (f"screen: {dropped} candidates screened out (clearly slower than their region's best); {audited} more it "
            f"would have dropped were timed in full as a check, and {missed} of them beat that best{rate}")


class Bars:
    """The search's best so far per (region, generation), kept by the loop as trials finish and
    read by the lanes at each launch (off: the screen is not used, `agent tune --no-screen`)."""

    def __init__(self, on: bool = True):
        self.on = on
        self.by: dict[tuple[str, str], ScreenBar | None] = {}
        self.draw = random.SystemRandom()

    def update(self, region: str, generation: str, trials: Iterable[Any]) -> None:
        """`trials`: the region's latest trial of each candidate on `generation`."""
        self.by[(region, generation)] = bar(trials)

    def __call__(self, region: str, generation: str) -> ScreenBar | None:
        """The bar a launch of `region` on `generation` is screened against, if any: a random
        AUDIT_SHARE of launches are timed in full even where the screen would drop them."""
        got = self.by.get((region, generation)) if self.on else None
        return replace(got, audit=self.draw.random() < AUDIT_SHARE) if got else None
