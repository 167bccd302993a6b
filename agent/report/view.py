"""What the report says, built once from `ReportData`: every number, verdict and sentence as
text, in plain dataclasses. prompts/report/report.md.j2 and report.html.j2 lay this one view
out, so report.md and report.html say the same things and differ only in markup.

A field marked `LAYOUT` places or draws something (a colour, a line number, a whole SVG); every
other string is a fact that both files show (tests/test_review.py holds them to it).
"""

from __future__ import annotations

import difflib
import time
from dataclasses import dataclass, field

from agent.report.data import MAX_EXAMPLES, RegionView, ReportData, run_state
from agent.report.lead import fmt_fraction, headline, lead, stated, weighted_floor
from agent.report.numbers import (cpu_headline, device_time, fmt_err, fmt_ms, fmt_params, fmt_speedup, region_state,
                                  standings, tidy, weighted_totals, within)
from tools.e2e import IntegrationResult

LAYOUT = {"layout": True}
MAX_DIFF_LINES = 600


@dataclass
class Mark:
    """A value and how it reads: `good` True (within the tolerance, the fastest), False (outside
    it), None (nothing to judge)."""
    text: str
    good: bool | None = field(default=None, metadata=LAYOUT)


@dataclass
class Card:
    value: str
    label: str


@dataclass
class WorkloadRow:
    name: str
    weight: str
    eager: str
    tuned: str
    speedup: str
    error: Mark
    fastest: str


@dataclass
class WaysRow:
    name: str
    times: list[Mark]
    """One per way (eager, nightshift, then `EndToEnd.ways`); `good` marks the fastest."""


@dataclass
class EndToEnd:
    device: str
    generation: str
    kind: str
    unit: str
    speedup: str
    """The lead, in bold: what our kernels add to the fastest way without them (the best compile
    mode; eager where none was timed), weighted; "correctness only" on a CPU run, "" when nothing
    was compared. `headline` goes on from it (after a space, or straight on when it starts with ":")."""
    headline: str
    workloads: list[WorkloadRow]
    ways: list[str]
    way_rows: list[WaysRow]
    totals_over: str
    """What the weighted totals sum ("" with one workload: they would repeat its row)."""
    totals: list[Card]
    floor_rows: list[WaysRow]
    """Per workload (then weighted, with several) the roofline floor and each way's fraction of it
    (floor / time), in the order of `ways`; empty where the model has no floor."""
    floor_missing: str
    """Why there is no floor ("" when there is one)."""
    notes: list[str]


@dataclass
class DiffLine:
    kind: str = field(metadata=LAYOUT)
    """`add`, `del`, or "" for context."""
    sign: str = field(metadata=LAYOUT)
    old_no: int | None = field(metadata=LAYOUT)
    new_no: int | None = field(metadata=LAYOUT)
    text: str


@dataclass
class Hunk:
    header: str
    lines: list[DiffLine]


@dataclass
class Diff:
    old_name: str
    new_name: str
    hunks: list[Hunk]
    cut: bool = field(metadata=LAYOUT)
    """More hunks than MAX_DIFF_LINES: the rest is left out (the file is in the run folder)."""
    old_source: str = field(metadata=LAYOUT)
    new_source: str = field(metadata=LAYOUT)


@dataclass
class TimingRow:
    generation: str
    workload: str
    weight: str
    baseline: str
    best: str
    speedup: str
    error: Mark
    flags: str


@dataclass
class Winner:
    candidate: str
    planner: str
    template: str
    params: str
    speedup: str
    per_generation: str
    unit: str
    rows: list[TimingRow]
    source_path: str
    diff: Diff | None
    """None: no file with the winner's content hash was found (`looked_at` says where)."""
    looked_at: str


@dataclass
class Region:
    name: str
    region_class: str
    share: str
    tolerance: str
    tolerance_source: str
    trials: str
    passed: str
    kept: str
    generations: str
    best: str
    per_generation: str
    error: Mark
    planner: str
    template: str
    state: str
    """What its search came to (agent.report.numbers.region_state)."""
    winner: Winner | None


@dataclass
class RejectedTrial:
    candidate: str
    planner: str
    template: str
    generation: str
    reason: str


@dataclass
class RejectedStatus:
    status: str
    count: str
    shown: str
    """"the last 3 of 5" when not every such trial is listed, else ""."""
    trials: list[RejectedTrial]


@dataclass
class Rejected:
    region: str
    statuses: list[RejectedStatus]


@dataclass
class Chart:
    name: str = field(metadata=LAYOUT)
    title: str
    file: str = field(metadata=LAYOUT)
    svg: str = field(metadata=LAYOUT)


@dataclass
class ReportView:
    title: str
    model_file: str
    versions: str
    generated: str
    timing_note: str
    cpu_only: bool = field(metadata=LAYOUT)
    cards: list[Card]
    state: str
    unjailed: str
    planner_stops: list[str]
    e2e: EndToEnd | None
    e2e_missing: str
    """Why there are no end-to-end numbers ("" when there are)."""
    charts: list[Chart]
    regions: list[Region]
    rejected: list[Rejected]
    skipped: list[str]
    rebuild: str


def build(data: ReportData) -> ReportView:
    """The report's view of a run (draws its charts, so matplotlib is imported here)."""
    from agent.report.plots import plots
    info, res = data.info, data.integration
    versions = " · ".join(f"{k} {v}" for k, v in info.versions.items()
                          if k in ("torch", "triton", "cuda") and v not in ("", "None"))
    missing = "" if res else (data.integration_error or "Integration has not run yet").rstrip(".") + \
        ": there are no end-to-end numbers for this run; the per-region results below are from the search alone."
    return ReportView(
        title=f"nightshift report: {data.run.run_id}", model_file=info.model_file, versions=versions,
        generated=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(data.generated_at)),
        timing_note=data.timing_note, cpu_only=data.cpu_only, cards=_cards(data), state=run_state(data),
        unjailed=data.unjailed or "", planner_stops=[tidy(why) for why in data.planner_stops],
        e2e=end_to_end(res, (info.options or {}).get("trace")) if res else None, e2e_missing=missing,
        charts=[Chart(name, title, f"report-{name}.svg", svg) for name, (title, svg) in plots(data).items()],
        regions=[region(data, r) for r in data.regions], rejected=rejected(data),
        skipped=[f"Region {name} was not frozen: {tidy(why)}" for name, why in info.skipped.items()],
        rebuild=f"agent report {data.run.path}")


def _cards(data: ReportData) -> list[Card]:
    res = data.integration
    figure, _ = headline(res) if res else ("", "")
    le = lead(res) if res else None
    e2e = (figure if le.said != "no change" else f"no change ({figure})") if figure else "not yet"
    label = "end to end: integration has not run yet"
    if res is None and data.integration_error:
        e2e, label = "none", "end to end: integration gave no result (why: below)"
    if res:
        against = f"the best compile mode ({le.rival})" if le.against_compiler else "eager (no compile mode timed)"
        label = (f"end to end, weighted: the best way with our kernels against {against}"
                 + (f", A/A noise band ±{le.band:.1%}" if figure else ""))
        if res.timing_kind == "cpu":  # correctness only: a CPU timing is no speedup
            e2e, label = "correctness only", cpu_headline(res)
        outside = [w.name for w in res.workloads if within(w.error, w.tolerance) is False]
        label += f"; error outside the tolerance on {', '.join(outside)}" if outside else ""
    hours, _, unit = device_time(data.gpu_seconds, data.cpu_only).partition(" ")
    passed = sum(r.counts.get("ok", 0) for r in data.regions)
    return [Card(e2e, label), Card(str(len(data.history.trials)), f"trials run ({passed} passed)"),
            Card(str(data.kept), "candidates kept (passed on every target generation)"),
            Card(hours, f"{unit} spent"), Card(f"${data.usd:.2f}", "spent on LLM calls")]


def _error(error: float | None, tolerance: str) -> Mark:
    return Mark(fmt_err(error, tolerance), within(error, tolerance))


def end_to_end(res: IntegrationResult, trace: str | None = None) -> EndToEnd:
    """Integration's numbers: per workload, against every way of running the model, and what was
    applied, dropped or failed. `trace`: the request trace the workloads' weights came from."""
    unit = "CPU ms" if res.timing_kind == "cpu" else "ms"
    speedup, said = stated(res)
    said += "".join(f" The error is OUTSIDE the tolerance on {w.name}." for w in res.workloads
                    if within(w.error, w.tolerance) is False)
    rows = [WorkloadRow(w.name, f"{w.weight:g}", fmt_ms(w.eager_ms), fmt_ms(w.tuned_ms), fmt_speedup(w),
                        _error(w.error, w.tolerance), standings(w)[1]) for w in res.workloads]
    ways = list(dict.fromkeys(n for w in res.workloads for n in w.baselines))
    way_rows = []
    for w in res.workloads:
        times = dict(standings(w)[0])
        fastest = min((ms for ms in times.values() if ms), default=None)
        way_rows.append(WaysRow(w.name, [Mark("failed", False) if times.get(n) is None else
                                         Mark(fmt_ms(times[n]), True if times[n] == fastest else None)
                                         for n in ["eager", "nightshift", *ways]]))
    over = (f"the trace `{trace}` (weight = calls of each shape in it, so this is its device time)" if trace
            else "the workloads (sum of weight x time)")
    totals = [Card("failed" if t is None else f"{t:.4g}", n) for n, t in weighted_totals(res)]
    notes = [f"Applied {a.region} {a.candidate_hash}" + (f" ({a.region_speedup:.2f}x alone)." if a.region_speedup
                                                         else ".") for a in res.accepted]
    notes += [f"Dropped {d.region} {d.candidate_hash}: {tidy(d.reason)}." for d in res.dropped]
    notes += [f"Baseline {k} failed: {tidy(v)}." for k, v in res.baseline_errors.items()]
    notes += [f"{k}: torch.compile {tidy(v)}; its time is not the compiler's." for k, v in res.baseline_fallbacks.items()]
    notes += [tidy(str(n)) for n in res.notes]
    kind = "CPU timings, not GPU numbers" if res.timing_kind == "cpu" else "GPU timings"
    several = len(res.workloads) > 1
    floors, missing = floor_rows(res, ways)
    return EndToEnd(res.device_name or res.device, res.generation or "?", kind, unit, speedup, said, rows, ways,
                    way_rows, f"Weighted total over {over}, {unit}" if several else "", totals if several else [],
                    floors, missing, notes)


def floor_rows(res: IntegrationResult, ways: list[str]) -> tuple[list[WaysRow], str]:
    """Per workload the roofline floor and each way's fraction of it (then the weighted row), or
    why there is none."""
    if not any(w.floor_ms for w in res.workloads):
        return [], ("No roofline floor was recorded for this model's workloads (the device's ceilings were not "
                    "measured, or the run was frozen before the whole model carried one)")
    names, rows = ["eager", "nightshift", *ways], []
    for w in res.workloads:
        times = dict(standings(w)[0])
        rows.append(WaysRow(w.name, [Mark(fmt_ms(w.floor_ms))] + [Mark(fmt_fraction(w.floor_ms, times.get(n)))
                                                                   for n in names]))
    if len(res.workloads) > 1:
        total, floor = dict(weighted_totals(res)), weighted_floor(res)
        rows.append(WaysRow("weighted", [Mark(fmt_ms(floor))] + [Mark(fmt_fraction(floor, total.get(n))) for n in names]))
    return rows, ""


def _refused(problem) -> str:
    """Templates written for this kind of region that refused it, and why (a mask they cannot read).
    Only cache-fed regions have such templates: others skip the library's import (it imports torch)."""
    if not problem.inplace_inputs:
        return ""
    from agent.planners.library import refusals
    said = refusals(problem)
    return f" No template candidate from {'; '.join(said)}." if said else ""


def region(data: ReportData, r: RegionView) -> Region:
    p, b = r.problem, r.best
    tolerance = str(p.tolerance)
    facts = dict(name=p.name, region_class=p.region_class, share=f"{p.share_of_model:.0%}", tolerance=tolerance,
                 tolerance_source=p.tolerance_source, trials=str(sum(r.counts.values())),
                 passed=str(r.counts.get("ok", 0)), kept=str(r.kept), generations=", ".join(r.gens) or "-",
                 state=region_state(sum(r.counts.values()), r.counts.get("ok", 0), r.kept) + _refused(p))
    if not b:
        return Region(**facts, best="-", per_generation="-", error=Mark(f"- / {tolerance}"), planner="-",
                      template="-", winner=None)
    # A CPU run shows correctness only: its best candidate, never a speedup.
    per_gen = "correctness only" if data.cpu_only else \
        ", ".join(f"{g} {s:.2f}x ({data.kind(g)})" for g, s in sorted(b.speedups().items()))
    rows = [TimingRow(f"{g} ({data.kind(g)})", w.workload, f"{p.weights.get(w.workload, 0):.2f}",
                      f"{w.baseline_ms:.4g}", f"{w.candidate_ms:.4g}", f"{w.speedup:.2f}x",
                      _error(t.error, tolerance), ", ".join(t.flags) or "-")
            for g, t in sorted(b.by_generation.items()) for w in t.timings]
    old_name, new_name = f"{p.region_class}.forward (original)", f"candidates/{b.candidate_hash}.py"
    winner = Winner(b.candidate_hash, b.planner, b.template or "-", fmt_params(b.params), "" if data.cpu_only else f"{r.score:.2f}x", per_gen,
                    "CPU ms" if data.cpu_only else "ms", rows, str(r.source_path or ""),
                    None if r.source is None else diff(r.original_forward, r.source, old_name, new_name),
                    ", ".join(r.looked_at))
    return Region(**facts, best=b.candidate_hash if data.cpu_only else winner.speedup, per_generation=per_gen,
                  error=_error(next(iter(b.by_generation.values())).error, tolerance), planner=b.planner,
                  template=winner.template, winner=winner)


def _span(start: int, length: int) -> str:
    """A hunk's line range as a unified diff writes it (`3`, `3,4`, or `2,0` for none)."""
    if length == 1:
        return f"{start + 1}"
    return f"{start if length == 0 else start + 1},{length}"


def diff(old: str, new: str, old_name: str, new_name: str, context: int = 3) -> Diff:
    """A unified diff of two sources, in hunks of numbered lines; cut after MAX_DIFF_LINES."""
    a, b = old.removesuffix("\n").split("\n"), new.removesuffix("\n").split("\n")
    groups = list(difflib.SequenceMatcher(None, a, b, autojunk=False).get_grouped_opcodes(context))
    hunks, shown = [], 0
    for group in groups:
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        lines = []
        for tag, a1, a2, b1, b2 in group:
            if tag == "equal":
                lines += [DiffLine("", " ", a1 + k + 1, b1 + k + 1, b[b1 + k]) for k in range(b2 - b1)]
                continue
            lines += [DiffLine("del", "-", i + 1, None, a[i]) for i in range(a1, a2)]
            lines += [DiffLine("add", "+", None, j + 1, b[j]) for j in range(b1, b2)]
        hunks.append(Hunk(f"@@ -{_span(i1, i2 - i1)} +{_span(j1, j2 - j1)} @@", lines))
        shown += len(lines) + 1
        if shown > MAX_DIFF_LINES:
            break
    return Diff(old_name, new_name, hunks, len(hunks) < len(groups), old, new)


def rejected(data: ReportData) -> list[Rejected]:
    """Per region, per status (alphabetical), how many trials ended so and the last few of them."""
    out = []
    for r in data.regions:
        statuses = []
        for status, trials in sorted(r.rejected.items()):
            shown = trials[-MAX_EXAMPLES:]
            statuses.append(RejectedStatus(
                status, str(len(trials)), f"the last {len(shown)} of {len(trials)}" if len(trials) > len(shown) else "",
                [RejectedTrial(t.candidate_hash, t.planner, t.template or "-", t.generation, tidy(t.reason))  # whole: a reason cut short says something else
                 for t in shown]))
        if statuses:
            out.append(Rejected(r.name, statuses))
    return out
