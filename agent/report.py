"""The morning report: `runs/<run>/report.md` and a self-contained `runs/<run>/report.html`.

Summary first (end-to-end speedup per workload and device generation with its error against
the tolerance, from integration.json when integration has run; GPU-hours, LLM dollars, trials
run and kept; where the tuner stands against eager and torch.compile), then the search-progress
plots, then per region the best kept candidate (times per workload, speedup per generation,
error against the tolerance, who found it, its diff against the original source) and what was
rejected and why. Built from the store opened read-only, so it can be rebuilt mid-run.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from agent.history import CandidateRecord, History
from tools.e2e import IntegrationResult
from tools.problem import Problem
from tools.runfolder import RunFolder, RunInfo
from tools.trial import Trial

MAX_EXAMPLES = 3


@dataclass
class RegionView:
    problem: Problem
    gens: list[str]
    counts: dict[str, int]
    kept: int
    best: CandidateRecord | None
    failures: list[Trial]
    source: str | None = None
    """The winning candidate's source (None: not kept, or its file is gone)."""
    source_path: Path | None = None

    @property
    def name(self) -> str:
        return self.problem.name

    @property
    def score(self) -> float | None:
        return self.best.score(self.gens) if self.best else None

    def unified_diff(self) -> list[str]:
        if self.source is None:
            return []
        return list(difflib.unified_diff(self.problem.region_source.splitlines(), self.source.splitlines(),
                                         f"{self.problem.region_class} (original)",
                                         f"candidates/{self.best.candidate_hash}.py", lineterm=""))


@dataclass
class ReportData:
    run: RunFolder
    info: RunInfo
    problems: list[Problem]
    history: History
    regions: list[RegionView]
    usd: float
    stop: str | None
    timing: dict[str, str]
    """Generation -> `cpu` or `cuda`: how that generation's trials were timed."""
    integration: IntegrationResult | None = None
    integration_error: str | None = None
    generated_at: float = field(default_factory=time.time)

    @property
    def gpu_seconds(self) -> float:
        return sum(t.gpu_seconds for t in self.history.trials)

    @property
    def cpu_only(self) -> bool:
        kinds = set(self.timing.values()) or {"cpu" if all(p.device == "cpu" for p in self.problems) else "cuda"}
        return kinds == {"cpu"}

    @property
    def timing_note(self) -> str:
        if self.cpu_only:
            return "CPU timings (host clock, not GPU numbers)"
        cpu = sorted(g for g, k in self.timing.items() if k == "cpu")
        return "GPU timings" + (f"; CPU timings (not GPU numbers) for {', '.join(cpu)}" if cpu else "")

    def kind(self, generation: str) -> str:
        """`CPU` or `GPU`, for labelling a number measured on this generation."""
        return "CPU" if self.timing.get(generation, "cpu" if self.cpu_only else "cuda") == "cpu" else "GPU"

    @property
    def kept(self) -> int:
        return sum(r.kept for r in self.regions)

    def progress(self) -> tuple[dict[str, list[tuple[float, float]]], dict[str, list[tuple[float, float]]]]:
        """Per region the best kept speedup so far, against trial number and against
        cumulative device seconds (a point each time it improves)."""
        by_trial: dict[str, list[tuple[float, float]]] = {p.name: [] for p in self.problems}
        by_time: dict[str, list[tuple[float, float]]] = {p.name: [] for p in self.problems}
        replay, best, spent = History(self.history.generations), {}, 0.0
        targets = {p.name: self.history.targets(p.name) for p in self.problems}
        for i, t in enumerate(self.history.trials, 1):
            spent += t.gpu_seconds
            score = replay.add(t).score(targets.get(t.region) or [t.generation])
            if score > best.get(t.region, 0.0):
                best[t.region] = score
                by_trial.setdefault(t.region, []).append((i, score))
                by_time.setdefault(t.region, []).append((spent, score))
        return by_trial, by_time


def _candidate_source(run: RunFolder, trial: Trial) -> tuple[str | None, Path | None]:
    """The candidate's file: its recorded path (absolute, or relative to where tune ran), else
    the run's own copy. A file whose content hash matches the trial's is preferred."""
    paths = []
    if trial.candidate_path:
        p = Path(trial.candidate_path)
        paths += [p] if p.is_absolute() else [Path.cwd() / p, run.path.parent / p]
    paths.append(run.candidates_dir / f"{trial.candidate_hash}.py")
    found = []
    for p in paths:
        try:
            text = p.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        if hashlib.sha256(text.encode()).hexdigest()[:16] == trial.candidate_hash:
            return text, p
        found.append((text, p))
    return found[0] if found else (None, None)


def _timing_kind(trial: Trial) -> str:
    if trial.timings:
        return "cpu" if all(w.timing_kind == "cpu" for w in trial.timings) else "cuda"
    return "cpu" if trial.device.partition(":")[0].partition("@")[0] == "cpu" else "cuda"


def collect(run: RunFolder) -> ReportData:
    """Everything the report shows, read from the run folder; the store is opened read-only
    (and not at all when the run has none yet)."""
    problems = run.problems()
    history = History({p.name: p.target_generations for p in problems})
    usd, stop = 0.0, None
    if (run.path / "trials.sqlite").is_file():
        store = run.store(readonly=True)
        try:
            for trial in store.trials():
                history.add(trial)
            usd = store.llm_usd()
            row = store.db.execute("SELECT body FROM events WHERE kind = 'stop' ORDER BY id DESC LIMIT 1").fetchone()
            stop = json.loads(row[0]).get("reason") if row else None
        finally:
            store.close()
    timing: dict[str, str] = {}
    for t in history.trials:  # a generation timed with CUDA events even once is a GPU
        if timing.get(t.generation) != "cuda":
            timing[t.generation] = _timing_kind(t)
    regions = []
    for p in problems:
        best = history.best(p.name)
        source, path = _candidate_source(run, best.by_generation[next(iter(best.by_generation))]) if best else (None, None)
        regions.append(RegionView(p, history.targets(p.name), history.counts(p.name), len(history.kept(p.name)), best,
                                  history.failures(p.name, MAX_EXAMPLES), source, path))
    data = ReportData(run, run.info(), problems, history, regions, usd, stop, timing)
    try:
        data.integration = IntegrationResult.load(run.path)
    except (ValueError, OSError) as e:
        data.integration_error = f"integration.json could not be read: {str(e).splitlines()[0]}"
    return data


# -- numbers shared by the markdown and the HTML ---------------------------------------------
def e2e_speedup(result: IntegrationResult) -> float | None:
    """Weighted over workloads, like a region's: sum(w * eager) / sum(w * tuned)."""
    rows = [w for w in result.workloads if w.weight > 0]
    if not rows or any(w.tuned_ms is None for w in rows):
        return None
    tuned = sum(w.weight * w.tuned_ms for w in rows)
    return sum(w.weight * w.eager_ms for w in rows) / tuned if tuned > 0 else None


def within(error: float | None, tolerance: str) -> bool | None:
    """Whether an error is inside a tolerance written as `abs 0.01` / `rel:1e-3` / `0.01`."""
    parts = tolerance.replace(":", " ").split()
    try:
        bound = float(parts[-1])
    except (ValueError, IndexError):
        return None
    return None if error is None else (math.isfinite(error) and error <= bound)


def standings(w) -> tuple[list[tuple[str, float | None]], str]:
    """Every way of running one workload (eager, nightshift, each torch.compile mode) with its
    time, and one honest sentence on which is fastest."""
    rows = [("eager", w.eager_ms), ("nightshift", w.tuned_ms), *w.baselines.items()]
    timed = sorted((ms, name) for name, ms in rows if ms is not None and ms > 0)
    if not timed:
        return rows, "nothing was timed"
    (fast_ms, fastest), others = timed[0], timed[1:]
    if fastest == "nightshift":
        nxt = f", {others[0][0] / fast_ms:.2f}x ahead of {others[0][1]}" if others else ""
        return rows, f"nightshift is fastest{nxt}"
    if w.tuned_ms is None:
        return rows, f"{fastest} is fastest ({fast_ms:.4g} ms); the tuned model was not timed"
    return rows, f"{fastest} is fastest ({fast_ms:.4g} ms); nightshift is {w.tuned_ms / fast_ms:.2f}x slower than it"


def fmt_ms(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.4g}"


def fmt_err(error: float | None, tolerance: str) -> str:
    verdict = {True: " (within)", False: " (OUTSIDE)", None: ""}[within(error, tolerance)]
    return f"{'-' if error is None else f'{error:.2g}'} / {tolerance or '?'}{verdict}"


def device_time(data: ReportData) -> str:
    h = data.gpu_seconds / 3600
    return f"{h:.4f} device-hours on the CPU" if data.cpu_only else f"{h:.4f} GPU-hours"


# -- markdown ----------------------------------------------------------------------------------
def render_md(data: ReportData, images: dict[str, str] | None = None) -> str:
    info, L = data.info, []
    L += [f"# nightshift report: {data.run.run_id}", "",
          f"Model `{info.model_file}` · {len(data.history.trials)} trials · {device_time(data)} · "
          f"${data.usd:.2f} of LLM calls · {data.timing_note}", "",
          f"Stopped: {data.stop}." if data.stop else "No stop recorded: the run is still going (or was killed).", "",
          "## End to end", ""]
    L += _md_integration(data)
    L += ["", "## Regions", "",
          "| region | share of model | trials | passing | best speedup | per generation | error / tolerance | template |",
          "|---|---|---|---|---|---|---|---|"]
    for r in data.regions:
        p, best, counts = r.problem, r.best, r.counts
        if best:
            per_gen = ", ".join(f"{g} {s:.2f}x ({data.kind(g)})" for g, s in sorted(best.speedups().items()))
            err = next(iter(best.by_generation.values())).error
            L.append(f"| {p.name} | {p.share_of_model:.0%} | {sum(counts.values())} | {counts.get('ok', 0)} | "
                     f"{r.score:.2f}x | {per_gen} | {fmt_err(err, str(p.tolerance))} | {best.template or '-'} |")
        else:
            L.append(f"| {p.name} | {p.share_of_model:.0%} | {sum(counts.values())} | {counts.get('ok', 0)} | - | - | "
                     f"- / {p.tolerance} | - |")
    if images:
        L += [""] + [f"![{alt}]({src})" for alt, src in images.items()]
    for r in data.regions:
        L += ["", f"### {r.name}", ""] + _md_region(data, r)
    L += ["", "## Rejected candidates by reason", ""]
    for r in data.regions:
        fails = {k: v for k, v in r.counts.items() if k != "ok"}
        if fails:
            L.append(f"- **{r.name}**: " + ", ".join(f"{k} {v}" for k, v in sorted(fails.items())))
            for t in r.failures:
                L.append(f"  - `{t.candidate_hash}` {t.status.value} ({t.planner}/{t.template or '-'}): "
                         f"{t.reason[:160]}")
    for name, why in info.skipped.items():
        L.append(f"- region {name} was not frozen: {why}")
    return "\n".join(L) + "\n"


def _md_integration(data: ReportData) -> list[str]:
    res = data.integration
    if res is None:
        return [data.integration_error or "Integration has not run yet: no end-to-end numbers for this run."]
    kind = "CPU timings, not GPU numbers" if res.timing_kind == "cpu" else "GPU timings"
    unit = "CPU ms" if res.timing_kind == "cpu" else "ms"
    sp = e2e_speedup(res)
    L = [f"On {res.device_name or res.device} (generation {res.generation or '?'}; {kind}): "
         + (f"**{sp:.2f}x** end to end, weighted over workloads." if sp else "no end-to-end speedup measured.")
         + "".join(f" The error is OUTSIDE the tolerance on {w.name}." for w in res.workloads
                   if within(w.error, w.tolerance) is False), "",
         f"| workload | generation | eager {unit} | tuned {unit} | speedup | error / tolerance | fastest |", "|---|---|---|---|---|---|---|"]
    for w in res.workloads:
        L.append(f"| {w.name} | {res.generation or '?'} | {fmt_ms(w.eager_ms)} | {fmt_ms(w.tuned_ms)} | "
                 f"{'-' if w.speedup is None else f'{w.speedup:.2f}x'} | {fmt_err(w.error, w.tolerance)} | "
                 f"{standings(w)[1]} |")
    names = list(dict.fromkeys(n for w in res.workloads for n in w.baselines))
    if names:
        L += ["", f"Against torch.compile ({unit}; failed: did not compile or run):", "",
              "| workload | eager | nightshift | " + " | ".join(names) + " |", "|---" * (3 + len(names)) + "|"]
        for w in res.workloads:
            t = dict(standings(w)[0])
            L.append(f"| {w.name} | " + " | ".join("failed" if t.get(n) is None else fmt_ms(t[n])
                                                  for n in ["eager", "nightshift", *names]) + " |")
    notes = [f"Applied {a.region} `{a.candidate_hash}`" + (f" ({a.region_speedup:.2f}x alone)." if a.region_speedup
                                                           else ".") for a in res.accepted]
    notes += [f"Dropped {d.region} `{d.candidate_hash}`: {d.reason}." for d in res.dropped]
    notes += [f"Baseline {k} failed: {v}." for k, v in res.baseline_errors.items()]
    notes += [str(n) for n in getattr(res, "notes", [])]
    return L + ([""] + [f"- {n}" for n in notes] if notes else [])


def _md_region(data: ReportData, r: RegionView) -> list[str]:
    p = r.problem
    L = [f"`{p.region_class}` · {p.share_of_model:.0%} of the model · tolerance {p.tolerance} ({p.tolerance_source}) · "
         f"{sum(r.counts.values())} trials, {r.kept} kept"]
    if not r.best:
        return L + ["", "No candidate passed the tolerance on every target generation yet."]
    b, unit = r.best, "CPU ms" if data.cpu_only else "ms"
    L += ["", f"Best: `{b.candidate_hash}` from planner {b.planner}, template {b.template or '-'} "
          f"{b.params or ''} · speedup {r.score:.2f}x (smallest over generations)", "",
          f"| generation | workload | weight | baseline {unit} | best {unit} | speedup | error / tolerance |",
          "|---|---|---|---|---|---|---|"]
    for g, t in sorted(b.by_generation.items()):
        for w in t.timings:
            L.append(f"| {g} ({data.kind(g)}) | {w.workload} | {p.weights.get(w.workload, 0):.2f} | "
                     f"{w.baseline_ms:.4g} | {w.candidate_ms:.4g} | {w.speedup:.2f}x | {fmt_err(t.error, str(p.tolerance))} |")
    diff = r.unified_diff()
    if diff:
        L += ["", "```diff", *diff, "```"]
    else:
        L += ["", f"(the source of `{b.candidate_hash}` was not found; it is not in the run's candidates/ folder)"]
    return L


# -- files -----------------------------------------------------------------------------------
def _write(path: Path, text: str) -> Path:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def write_html(run: RunFolder, data: ReportData | None = None) -> Path:
    from agent.report_html import render_html
    return _write(run.path / "report.html", render_html(data or collect(run)))


def write(run: RunFolder) -> Path:
    """report.md (with its plots as SVG files beside it) and report.html; returns report.md."""
    from agent.report_html import plots
    data = collect(run)
    images = {}
    for name, svg in plots(data).items():
        images[name] = _write(run.path / f"report-{name}.svg", svg).name
    write_html(run, data)
    return _write(run.path / "report.md", render_md(data, images))
