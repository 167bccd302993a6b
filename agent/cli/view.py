"""What a person watches: per region the trials done, passing, best speedup and its error
against the tolerance, and the budget left. The same table serves the live view of
`agent tune` and `agent status RUN` for a run started elsewhere."""

from __future__ import annotations

from rich.table import Table

from agent.history import History
from agent.report.lead import as_json
from agent.report.numbers import region_state, times
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
            "state": region_state(sum(counts.values()), counts.get("ok", 0), len(history.kept(p.name))),
            "failures": {k: v for k, v in counts.items() if k != "ok"},
        })
    return rows


def progress_table(rows: list[dict], timing_kind: str, budget_line: str) -> Table:
    """Per region the trials, passing and kept, the best one's error and what was rejected; the
    best speedup only on a GPU (a CPU run shows correctness only: its timings are no speedup)."""
    cpu = timing_kind == "cpu"
    kind = "CPU run: correctness only, no speedup" if cpu else "GPU timings"
    table = Table(title=f"nightshift: search progress ({kind})", caption=budget_line)
    cols = ("region", "trials", "passing", "kept", *(() if cpu else ("best speedup",)), "error / tolerance", "from",
            "rejected")
    for col in cols:
        table.add_column(col, justify="right" if col in ("trials", "passing", "kept", "best speedup") else "left")
    for r in rows:
        best = times(r['best_speedup']) if r["best_speedup"] else "-"
        if len(r["best_by_generation"]) > 1:
            best += " (" + ", ".join(f"{g} {times(s)}" for g, s in sorted(r["best_by_generation"].items())) + ")"
        err = f"{r['best_error']:.2g} / {r['tolerance']}" if r["best_error"] is not None else f"- / {r['tolerance']}"
        rejected = ", ".join(f"{k} {v}" for k, v in sorted(r["failures"].items(), key=lambda kv: -kv[1])[:3])
        table.add_row(r["region"], str(r["trials"]), str(r["passing"]), str(r["kept"]), *(() if cpu else (best,)),
                      err, r["best_template"] or "-", rejected or "-")
    return table


def budget_line(spent_s: float, cap_h: float, tried: int, max_candidates: int, timing_kind: str = "cuda") -> str:
    """The budget left; on the CPU the cap is device time, never called GPU time."""
    unit = "h on the CPU" if timing_kind == "cpu" else "GPU-h"
    return (f"device time {spent_s / 3600:.4f} of {cap_h:g} {unit} ({max(0.0, cap_h * 3600 - spent_s):.0f} s left)"
            f" · candidates {tried} of {max_candidates}")


def run_status(folder) -> dict:
    """Whether the run is being tuned now, has stopped (and how), or was killed mid-search."""
    from tools.runfolder import lock_holder
    pid, holder = lock_holder(folder)
    stop, clean, started = None, True, False
    if folder.check_store():
        store = folder.store(readonly=True)
        try:
            stop = store.last_event("stop")
            clean = store.ended_cleanly()
            started = bool(store.events("session")) or store.count() > 0
        finally:
            store.close()
    if pid is not None:
        return {"state": "running", "pid": pid, "since": holder, "stop_reason": None,
                "text": f"running now ({holder})"}
    if stop is None or not clean:
        state = "killed" if started else "not started"
        text = ("not running, and its last session recorded no stop: the tuner was killed "
                "(agent tune --resume to go on)" if started else "not tuned yet")
        return {"state": state, "pid": None, "since": None, "stop_reason": None, "text": text}
    reason = stop.get("reason", "")
    state = "interrupted" if reason.startswith("interrupted") else "finished"
    return {"state": state, "pid": None, "since": None, "stop_reason": reason,
            "text": f"{'stopped' if state == 'interrupted' else 'finished'}: {reason}"
                    + (" (agent tune --resume to go on)" if state == "interrupted" else "")}


def status_of(folder) -> tuple[dict, str]:
    """`agent status`: (what --json prints, the budget line under the table). `timing_kind` is
    `cpu` when no trial was timed on a GPU: the run shows correctness only."""
    from agent.history import load_history
    problems = folder.problems()
    history = load_history(folder, problems, [])
    rule = folder.info().options.get("stop_rule", {})
    spent = sum(t.gpu_seconds for t in history.trials)
    timed = [t.timing_kind for trial in history.trials for t in trial.timings]
    kind = ("cuda" if "cuda" in timed else "cpu") if timed else \
        ("cpu" if all(p.device == "cpu" for p in problems) else "cuda")
    data = {"run": str(folder.path), **run_status(folder), "timing_kind": kind,
            "regions": progress_rows(problems, history), "gpu_seconds": spent, "stop_rule": rule,
            "end_to_end": _end_to_end(folder)}
    return data, budget_line(spent, rule.get("gpu_hours", 0.0), len(history.records), rule.get("max_candidates", 0),
                             kind)


def _end_to_end(folder) -> dict | None:
    """The report's end-to-end lead (agent/report/lead.py), from integration.json; None before
    integration has run (`integration_failed` says why it gave none, where it failed)."""
    from tools.e2e import IntegrationResult, last_failure
    try:
        result = IntegrationResult.load(folder.path)
    except ValueError as e:  # a damaged file is said, not raised: status works on any run
        return {"error": f"integration.json unreadable: {str(e)[:200]}"}
    if result is None:
        return {"integration_failed": why} if (why := last_failure(folder.path)) else None
    return as_json(result)


def trial_lines(trial) -> list[str]:
    """`agent try`'s verdict for a person: status and reason, error against the tolerance,
    per-workload timings labelled CPU or GPU, flags, and the error text of a rejection."""
    lines = [f"{trial.status.value}: {trial.reason}" if trial.reason else trial.status.value]
    if trial.error is not None:
        fresh = "n/a" if trial.fresh_error is None else f"{trial.fresh_error:.3g}"
        lines.append(f"error {trial.error:.3g} vs tolerance {trial.tolerance}; fresh inputs {fresh}")
    for t in trial.timings:
        label = "CPU timing" if t.timing_kind == "cpu" else "GPU timing"
        lines.append(f"  {t.workload}: baseline {t.baseline_ms:.4f} ms, candidate {t.candidate_ms:.4f} ms, "
                     f"{times(t.speedup)} ({label}, spread {t.candidate_spread:.1%}, {t.reps} reps)")
    if trial.speedup:
        lines.append(f"weighted speedup {times(trial.speedup)}" + (" (CPU timing)" if trial.device == "cpu" else ""))
    lines += [f"flag: {f}" for f in trial.flags]
    if trial.error_text and trial.status.value != "ok":
        lines.append(trial.error_text[-1500:])
    return lines
