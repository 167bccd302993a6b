"""What the report leads with: the fastest way to run the model, and what our kernels add to it
against the best torch.compile mode, weighted over workloads; and how far each way is from the
roofline floor.

A user who already runs the compiler reads a speedup over eager as a win even where the compiler
alone is faster (a tuned model at 0.43x of reduce-overhead once led with "1.18x end to end"), so
eager is the yardstick only where no compile mode was timed, and the sentence says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.report.numbers import cpu_headline, standings, weighted_totals
from tools.e2e import IntegrationResult
from tools.trial import verdict

EAGER, OURS = "eager", "nightshift"


def ours(name: str) -> bool:
    """A way with our kernels: the tuned model, its CUDA graph, a compile mode with ours inside."""
    return name.startswith(OURS)


@dataclass(frozen=True)
class Lead:
    """The weighted standings (time = sum over workloads of weight x ms)."""
    fastest: str | None
    fastest_ms: float | None
    best_ours: str | None
    """The fastest way with our kernels."""
    ours_ms: float | None
    rival: str | None
    """The fastest way without them: the best compile mode; eager only where no mode was timed."""
    rival_ms: float | None
    against_compiler: bool
    """Whether `rival` is a compile mode (False: none was timed, so the rival is eager)."""
    ratio: float | None
    """rival_ms / ours_ms: above 1 our kernels add that much to the fastest way without them."""
    band: float
    said: str
    """`faster`, `slower` or `no change` (within `band`), "" when nothing was compared."""
    floor_ms: float | None
    """The roofline floor, weighted like the times (None where a workload has none)."""

    def as_json(self) -> dict:
        return {"fastest": self.fastest, "fastest_ms": self.fastest_ms, "best_ours": self.best_ours,
                "ours_ms": self.ours_ms, "rival": self.rival, "rival_ms": self.rival_ms,
                "against_compiler": self.against_compiler, "ratio": self.ratio, "band": self.band,
                "verdict": self.said, "floor_ms": self.floor_ms,
                "fraction_of_floor": {n: fraction(self.floor_ms, ms) for n, ms in
                                      ((self.fastest, self.fastest_ms), (self.best_ours, self.ours_ms),
                                       (self.rival, self.rival_ms)) if n}}


def fraction(floor_ms: float | None, ms: float | None) -> float | None:
    """floor / time: 1.0 is the roofline (None where either is unknown)."""
    return floor_ms / ms if floor_ms and ms and ms > 0 else None


def fmt_fraction(floor_ms: float | None, ms: float | None) -> str:
    f = fraction(floor_ms, ms)
    return "-" if f is None else f"{f:.0%}"


def weighted_floor(result: IntegrationResult) -> float | None:
    rows = [w for w in result.workloads if w.weight > 0]
    if not rows or any(not w.floor_ms for w in rows):
        return None
    return sum(w.weight * w.floor_ms for w in rows)


def _band(result: IntegrationResult, *names: str | None) -> float:
    """The weighted A/A band, widened by each named way's own (its worker may have been noisier)."""
    own = [b for w in result.workloads for n in names if n for b in [w.baseline_bands.get(n)] if b]
    return max([result.noise_band or 0.0, *own])


def lead(result: IntegrationResult) -> Lead:
    timed = sorted((ms, n) for n, ms in weighted_totals(result) if ms is not None and ms > 0)
    mine = [(ms, n) for ms, n in timed if ours(n)]
    compiled = [(ms, n) for ms, n in timed if not ours(n) and n != EAGER]
    rivals = compiled or [(ms, n) for ms, n in timed if n == EAGER]
    (ours_ms, best), (rival_ms, rival) = (mine[0] if mine else (None, None)), (rivals[0] if rivals else (None, None))
    ratio = rival_ms / ours_ms if ours_ms and rival_ms else None
    band = _band(result, best, rival)
    return Lead(timed[0][1] if timed else None, timed[0][0] if timed else None, best, ours_ms, rival, rival_ms,
                bool(compiled), ratio, band, verdict(ratio, band), weighted_floor(result))


def headline(result: IntegrationResult) -> tuple[str, str]:
    """The lead figure (what our kernels add to the fastest way without them; "" when nothing was
    compared) and the sentence that follows it."""
    le = lead(result)
    if le.ratio is None:
        return "", "no end-to-end speedup measured."
    many = ", weighted over workloads" if len(result.workloads) > 1 else ""
    against = f"against the best torch.compile mode, {le.rival}" if le.against_compiler else "against eager"
    within = f"{'inside' if le.said == 'no change' else 'beyond'} the A/A noise band of ±{le.band:.1%}"
    text = f"{against}{many}: {le.said} ({within}). "
    if le.said == "faster":
        text += f"The fastest way to run this model is {le.best_ours} ({_ms(le.ours_ms)} against {_ms(le.rival_ms)})."
    elif le.said == "slower":
        text += (f"The fastest way to run this model is {le.fastest} ({_ms(le.fastest_ms)}); the best way with our "
                 f"kernels, {le.best_ours}, takes {_ms(le.ours_ms)}: our kernels add nothing to it.")
    else:
        text += (f"The fastest ways to run this model are {le.rival} and {le.best_ours} ({_ms(le.rival_ms)} and "
                 f"{_ms(le.ours_ms)}); our kernels add nothing beyond the noise.")
    if not le.against_compiler:
        text += " No torch.compile mode was timed, so this says nothing against the compiler."
    if le.floor_ms:
        text += f" The roofline floor is {_ms(le.floor_ms)}: the fastest way runs at {fmt_fraction(le.floor_ms, le.fastest_ms)} of it."
    if not result.accepted:
        text += (" Nothing was applied: the ways with our kernels run the untouched model, and a difference is the "
                 "measurement's own cross-process offset, not a change.")
    return f"{le.ratio:.2f}x", text


def stated(result: IntegrationResult) -> tuple[str, str]:
    """The lead figure and sentence as the report states them: on a CPU run correctness only (a CPU
    timing says nothing of a GPU's), else `headline`."""
    return ("correctness only", f": {cpu_headline(result)}") if result.timing_kind == "cpu" else headline(result)


def as_json(result: IntegrationResult) -> dict:
    """What `agent status --json` and `agent integrate --json` say of the end to end: the report's
    lead, the standings, and per workload the floor and each way's fraction of it."""
    figure, said = stated(result)
    out = {"figure": figure, "headline": said.removeprefix(": "), "timing_kind": result.timing_kind,
           **lead(result).as_json(), "workloads": []}
    for w in result.workloads:
        times = {n: ms for n, ms in standings(w)[0] if ms}
        out["workloads"].append({"name": w.name, "weight": w.weight, "floor_ms": w.floor_ms, "ms": times,
                                 "fraction_of_floor": {n: fraction(w.floor_ms, ms) for n, ms in times.items()}})
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g} ms"
