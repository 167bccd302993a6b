"""The corpus report: runs/<corpus>/report.md and report.html, from one view of the corpus.

One row per model (eager, the best compile mode, our fastest way, ours against the best compile
mode, fast_1: something of ours applied, correct, and faster than the best compile mode beyond
the noise band), or why it was not integrated; one row per problem class (its members, the
winner its leader's search found, what became of it on each member); and the totals: trials and
device time spent, against an estimate of tuning each file alone (every member searched as its
leader was). Built from the stores opened read-only and each model's integration.json, so it can
be rebuilt mid-run (`agent report CORPUS`). A CPU run's timings are no speedups: its rows say
correctness only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from agent.history import History, load_history
from agent.report.numbers import times
from agent.report.render import render_named
from tools.corpus import CorpusFolder
from tools.e2e import IntegrationResult

OURS = "nightshift"


def model_numbers(res: IntegrationResult) -> dict:
    """Weighted over workloads: eager, the best compile mode, our fastest way (each way counted
    only where it ran on every workload), ours against the best compile mode, fast_1."""
    total = sum(w.weight for w in res.workloads) or 1.0
    ways: dict[str, float] = {"eager": sum(w.weight * w.eager_ms for w in res.workloads) / total}
    names = {OURS} | {n for w in res.workloads for n in w.baselines}
    for name in names:
        got = [w.tuned_ms if name == OURS else w.baselines.get(name) for w in res.workloads]
        if got and all(g for g in got):
            ways[name] = sum(w.weight * g for w, g in zip(res.workloads, got)) / total
    compiled = {n: ms for n, ms in ways.items() if n != "eager" and not n.startswith(OURS)}
    ours = {n: ms for n, ms in ways.items() if n.startswith(OURS)}
    best_mode = min(compiled, key=compiled.get) if compiled else None
    our_way = min(ours, key=ours.get) if ours else None
    rival = compiled[best_mode] if best_mode else ways["eager"]
    band = res.noise_band or 0.0
    vs = rival / ours[our_way] if our_way else None
    return {"eager_ms": ways["eager"], "compile_mode": best_mode, "compile_ms": compiled.get(best_mode),
            "way": our_way, "ours_ms": ours.get(our_way), "vs_compile": vs, "band": band,
            "fast_1": bool(res.accepted) and vs is not None and vs > 1 + band, "cpu": res.timing_kind == "cpu",
            "accepted": [a.region for a in res.accepted]}


@dataclass
class CorpusView:
    path: str
    cpu: bool
    models: list[dict] = field(default_factory=list)
    classes: list[dict] = field(default_factory=list)
    totals: dict = field(default_factory=dict)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def _model_row(name: str, state: str, reason: str, history: History | None, res: IntegrationResult | None) -> dict:
    trials = history.trials if history else []
    row = {"name": name, "trials": len(trials), "device_s": f"{sum(t.gpu_seconds for t in trials):.0f}",
           "eager": "-", "compile": "-", "ours": "-", "vs": "-", "fast_1": "-", "why": ""}
    if res is None:
        row["why"] = reason or ("could not be frozen" if state == "failed" else
                                "not integrated yet" if state != "done" else "not integrated: nothing was tried")
        return row
    n = model_numbers(res)
    row.update(eager=_ms(n["eager_ms"]), ours=f"{_ms(n['ours_ms'])} ({n['way']})" if n["way"] else "-",
               compile=f"{_ms(n['compile_ms'])} ({n['compile_mode']})" if n["compile_mode"] else "not timed")
    if n["cpu"]:
        row.update(vs="CPU: correctness only", fast_1="-")
    else:
        row.update(vs=times(n["vs_compile"]) if n["vs_compile"] else "-", fast_1="yes" if n["fast_1"] else "no")
    row["why"] = "" if n["accepted"] else "nothing applied: " + (reason or "no winner was faster")
    return row


def _member_cell(history: History, region: str, leader: bool, cpu: bool) -> str:
    recs = history.region_records(region)
    shared = [r for r in recs if "class_winner" in r.params]
    best = history.best(region)
    score = "" if cpu or best is None else f", {times(best.score(history.targets(region)))}"
    if leader:
        return f"searched: {len(recs)} candidates, best {best.candidate_hash[:8] if best else 'none'}{score}"
    passed = [r for r in shared if r.kept(history.targets(region))]
    if passed:
        return f"winner passed here ({len(passed)} of {len(shared)} verified){score}"
    if not shared:
        return "no winner to verify"
    searched = len(recs) - len(shared)
    return f"every winner failed here ({shared[0].failed().status.value if shared[0].failed() else '?'}): " \
           f"searched on its own, {searched} candidates{score}"


def build_corpus(folder: CorpusFolder) -> CorpusView:
    info = folder.info()
    runs = folder.runs()
    histories = {name: load_history(run, run.problems(), []) for name, run in runs.items()}
    results = {name: IntegrationResult.load(run.path) for name, run in runs.items()}
    cpu = all(r.timing_kind == "cpu" for r in results.values() if r) and all(
        p.device == "cpu" for run in runs.values() for p in run.problems())
    view = CorpusView(str(folder.path), cpu)
    for m in info.models:
        view.models.append({**_model_row(m.name, m.state, m.reason, histories.get(m.name), results.get(m.name)),
                            "run": f"models/{m.run}" if m.run else "-"})
    alone_trials = alone_s = 0.0
    for c in info.classes or []:
        lead_model, lead_region = c.members[0]
        lead = [t for t in histories[lead_model].trials if t.region == lead_region]
        alone_trials += len(lead) * len(c.members)
        alone_s += sum(t.gpu_seconds for t in lead) * len(c.members)
        best = histories[lead_model].best(lead_region)
        view.classes.append({
            "name": lead_region, "share": f"{c.share:.0%}",
            "winner": f"{best.candidate_hash[:8]} ({best.template or best.planner})" if best else "none",
            "members": [{"member": f"{model}/{region}", "result": _member_cell(histories[model], region, i == 0, cpu)}
                        for i, (model, region) in enumerate(c.members)]})
    trials = sum(len(h.trials) for h in histories.values())
    seconds = sum(t.gpu_seconds for h in histories.values() for t in h.trials)
    view.totals = {"trials": trials, "device_s": f"{seconds:.0f}", "alone_trials": int(alone_trials),
                   "alone_s": f"{alone_s:.0f}", "saved_trials": int(alone_trials - trials),
                   "saved_s": f"{alone_s - seconds:.0f}", "models": len(info.models),
                   "classes": len(info.classes or []),
                   "shared": sum(1 for c in info.classes or [] if len(c.members) > 1)}
    return view


def write_corpus_report(folder: CorpusFolder) -> Path:
    """report.md and report.html of the corpus; returns report.md's path."""
    view = build_corpus(folder)
    for name in ("corpus.md.j2", "corpus.html.j2"):
        out = folder.path / name.replace("corpus.", "report.").removesuffix(".j2")
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(render_named(f"report/{name}", v=view))
        tmp.replace(out)
    return folder.path / "report.md"
