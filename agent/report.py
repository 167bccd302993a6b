"""The morning report (markdown): per region the best kept candidate, its speedup per device
generation, its error against the tolerance, and what was rejected and why."""

from __future__ import annotations

from pathlib import Path

from agent.loop import load_history
from tools.runfolder import RunFolder


def write(run: RunFolder) -> Path:
    problems = run.problems()
    history = load_history(run, problems, [])
    info = run.info()
    kind = "CPU timings (not GPU numbers)" if all(p.device == "cpu" for p in problems) else "GPU timings"
    spent = sum(t.gpu_seconds for t in history.trials)
    store = run.store(readonly=True)
    try:
        usd = store.llm_usd()
    finally:
        store.close()
    lines = [f"# nightshift report: {run.run_id}", "",
             f"Model `{info.model_file}` · {len(history.trials)} trials · {spent / 3600:.4f} device-hours · "
             f"${usd:.2f} of LLM calls · {kind}", "",
             "| region | share of model | trials | passing | best speedup | per generation | error / tolerance | template |",
             "|---|---|---|---|---|---|---|---|"]
    for p in problems:
        best, counts, gens = history.best(p.name), history.counts(p.name), history.targets(p.name)
        per_gen = ", ".join(f"{g} {s:.2f}x" for g, s in sorted(best.speedups().items())) if best else "-"
        err = next(iter(best.by_generation.values())).error if best else None
        lines.append(f"| {p.name} | {p.share_of_model:.0%} | {sum(counts.values())} | {counts.get('ok', 0)} | "
                     f"{best.score(gens):.2f}x | {per_gen} | {err if err is None else f'{err:.2g}'} / {p.tolerance} | "
                     f"{best.template if best else '-'} |" if best else
                     f"| {p.name} | {p.share_of_model:.0%} | {sum(counts.values())} | {counts.get('ok', 0)} | - | - | "
                     f"- / {p.tolerance} | - |")
    lines += ["", "## Rejected candidates by reason", ""]
    for p in problems:
        fails = {k: v for k, v in history.counts(p.name).items() if k != "ok"}
        if fails:
            lines.append(f"- **{p.name}**: " + ", ".join(f"{k} {v}" for k, v in sorted(fails.items())))
            for t in history.failures(p.name, 3):
                lines.append(f"  - `{t.candidate_hash}` {t.status.value}: {t.reason[:160]}")
    for name, why in info.skipped.items():
        lines.append(f"- region {name} was not frozen: {why}")
    path = run.path / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
