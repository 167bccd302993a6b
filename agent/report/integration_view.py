"""Integration's end-to-end result for the terminal (`agent integrate`, the end of `agent
tune`) and for `--json`."""

from __future__ import annotations

from agent.report.lead import as_json, fmt_fraction, stated
from agent.report.numbers import standings
from tools.e2e import IntegrationResult, WorkloadResult
from tools.trial import error_line


def render(result: IntegrationResult, console_width: int | None = None):
    """The end-to-end table for the terminal (rich): per workload eager, tuned, speedup (or "no
    change" inside the noise band), baselines, and the error against the end-to-end tolerance;
    then what was kept and dropped."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text
    kind = "CPU timings, not GPU numbers" if result.timing_kind == "cpu" else f"GPU timings, {result.device_name}"
    names = list(dict.fromkeys(n for w in result.workloads for n in w.baselines))
    table = Table(title=f"end to end ({kind})", title_justify="left")
    floors = any(w.floor_ms for w in result.workloads)
    for col in ("workload", "eager ms", "tuned ms", "speedup", "noise band", *[f"{n} ms" for n in names],
                *(["floor ms (tuned's share)"] if floors else []), "error / tolerance"):
        table.add_column(col, justify="left" if col in ("workload", "error / tolerance") else "right")
    for w in result.workloads:
        cells = [w.name, f"{w.eager_ms:.4f}", _ms(w.tuned_ms), _verdict(w) + ("" if result.accepted else " (A/A)"),
                 f"±{w.noise_band:.1%}"]
        for n in names:
            ms, sp, band = w.baselines.get(n), w.baseline_speedups.get(n), w.baseline_bands.get(n) or 0.0
            # A way whose own worker was noisier than the tuned model's shows its own band.
            sure = f" ±{band:.0%}" if band > max(2 * w.noise_band, 0.02) else ""
            cells.append("failed" if ms is None else f"{ms:.4f} ({sp:.2f}x{sure})" if sp else f"{ms:.4f}")
        if floors:
            cells.append(f"{w.floor_ms:.4f} ({fmt_fraction(w.floor_ms, w.tuned_ms)})" if w.floor_ms else "-")
        cells.append(f"{w.error:.3g} / {w.tolerance}" if w.error is not None else f"- / {w.tolerance}")
        table.add_row(*cells)
    lines = [table]
    # As the report states it: a CPU run is correctness only (issue 53), never a speedup, labelled or not.
    if (said := stated(result))[0]:
        lines.append(Text(f"end to end: {said[0]}{'' if said[1].startswith(':') else ' '}{said[1]}"))
    for a in result.accepted:
        # A per-shape dispatcher has no one region speedup (each shape runs its fastest).
        alone = f"region {a.region_speedup:.2f}x, " if a.region_speedup else ""
        lines.append(Text(f"applied {a.region}: {a.candidate_hash} ({a.template or a.planner}, {alone}"
                          f"{a.instances} instance{'s' * (a.instances != 1)})"))
    for d in result.dropped:
        lines.append(Text(f"dropped {d.region} {d.candidate_hash}: {d.reason}"))
    for name, text in result.baseline_errors.items():
        lines.append(Text(f"baseline {name} failed: {error_line(text)}"))
    for name, why in result.baseline_fallbacks.items():
        lines.append(Text(f"{name}: torch.compile {why} (dynamo: {_counts(result.dynamo.get(name.split(' (')[0]))})"))
    for w in result.workloads:
        lines.append(Text(f"{w.name}: {standings(w)[1]}"))
    for n in result.notes:
        lines.append(Text(f"note: {n}"))
    return Group(*lines)


def _counts(info: dict | None) -> str:
    if not info:
        return "no counters"
    return (f"{info.get('graphs', 0)} graphs, {info.get('graph_breaks', 0)} breaks, "
            f"{info.get('recompiles', 0)} recompiles, compiled regions per call {info.get('regions')}")


def _verdict(w: WorkloadResult) -> str:
    if not w.speedup:
        return "-"
    return "no change" if w.verdict == "no change" else f"{w.speedup:.2f}x"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def summary(result: IntegrationResult) -> dict:
    """What `agent tune --json` prints about integration."""
    return {"speedup": result.speedup, "noise_band": result.noise_band, "timing_kind": result.timing_kind,
            "lead": as_json(result),
            "accepted": [a.region for a in result.accepted],
            "dropped": [{"region": d.region, "candidate": d.candidate_hash, "reason": d.reason}
                        for d in result.dropped],
            "workloads": [{**w.model_dump(), "fastest": standings(w)[1]} for w in result.workloads],
            "compile_fallbacks": result.baseline_fallbacks, "dynamo": result.dynamo}
