"""What a person watches: per region the trials done, passing, best speedup and its error
against the tolerance, and the budget left. The same table serves the live view of
`agent tune` and `agent status RUN` for a run started elsewhere."""

from __future__ import annotations

from rich.table import Table

from agent.history import History
from tools.problem import Problem


def progress_rows(problems: list[Problem], history: History) -> list[dict]:
    rows = []
    for p in problems:
        counts = history.counts(p.name)
        best = history.best(p.name)
        gens = history.targets(p.name)
        rows.append({
            "region": p.name, "trials": sum(counts.values()), "passing": counts.get("ok", 0),
            "kept": len(history.kept(p.name)),
            "best_speedup": best.score(gens) if best else None,
            "best_by_generation": best.speedups() if best else {},
            "best_error": next(iter(best.by_generation.values())).error if best else None,
            "tolerance": str(p.tolerance), "best_template": best.template if best else None,
            "failures": {k: v for k, v in counts.items() if k != "ok"},
        })
    return rows


def progress_table(rows: list[dict], timing_kind: str, budget_line: str) -> Table:
    kind = "CPU timings" if timing_kind == "cpu" else "GPU timings"
    table = Table(title=f"nightshift: search progress ({kind})", caption=budget_line)
    for col in ("region", "trials", "passing", "kept", "best speedup", "error / tolerance", "from", "rejected"):
        table.add_column(col, justify="right" if col in ("trials", "passing", "kept", "best speedup") else "left")
    for r in rows:
        best = f"{r['best_speedup']:.2f}x" if r["best_speedup"] else "-"
        if len(r["best_by_generation"]) > 1:
            best += " (" + ", ".join(f"{g} {s:.2f}x" for g, s in sorted(r["best_by_generation"].items())) + ")"
        err = f"{r['best_error']:.2g} / {r['tolerance']}" if r["best_error"] is not None else f"- / {r['tolerance']}"
        rejected = ", ".join(f"{k} {v}" for k, v in sorted(r["failures"].items(), key=lambda kv: -kv[1])[:3])
        table.add_row(r["region"], str(r["trials"]), str(r["passing"]), str(r["kept"]), best, err,
                      r["best_template"] or "-", rejected or "-")
    return table


def budget_line(spent_s: float, cap_h: float, tried: int, max_candidates: int) -> str:
    return (f"device time {spent_s / 3600:.4f} of {cap_h:g} GPU-h ({max(0.0, cap_h * 3600 - spent_s):.0f} s left)"
            f" · candidates {tried} of {max_candidates}")
