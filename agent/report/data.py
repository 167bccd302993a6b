"""What the report is about, read once from the run folder: agent/report/view.py turns this
`ReportData` into the one view that report.md and report.html both render.

The store is opened read-only, so the report can be rebuilt mid-run. A winner's source is
shown only when a file with exactly its content hash is found; otherwise the report says the
source is missing rather than show another file.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

from agent.history import CandidateRecord, History
from tools.e2e import IntegrationResult, last_failure
from tools.problem import Problem
from tools.runfolder import RunFolder, RunInfo
from tools.trial import Trial

MAX_EXAMPLES = 3
"""Rejected trials listed per region and status (the count always says how many there were)."""


@dataclass
class RegionView:
    problem: Problem
    gens: list[str]
    counts: dict[str, int]
    kept: int
    best: CandidateRecord | None
    rejected: dict[str, list[Trial]] = field(default_factory=dict)
    """Status -> every trial that ended with it (not `ok`), in the order they ran."""
    source: str | None = None
    """The winning candidate's source (None: not kept, or no file with its content is left)."""
    source_path: Path | None = None
    looked_at: list[str] = field(default_factory=list)
    """Where the winner's source was looked for (said when it is missing)."""

    @property
    def name(self) -> str:
        return self.problem.name

    @property
    def score(self) -> float | None:
        return self.best.score(self.gens) if self.best else None

    @property
    def original_forward(self) -> str:
        return original_forward(self.problem.region_source)

    def unified_diff(self) -> list[str]:
        """The original forward against the candidate file, which replaces exactly that method
        (the class's constructor is not part of what changed)."""
        if self.source is None:
            return []
        return list(difflib.unified_diff(self.original_forward.splitlines(), self.source.splitlines(),
                                         f"{self.problem.region_class}.forward (original)",
                                         f"candidates/{self.best.candidate_hash}.py", lineterm=""))


def original_forward(class_source: str) -> str:
    """The `forward` method of a class's source, dedented (the whole source if it has none)."""
    try:
        tree = ast.parse(textwrap.dedent(class_source))
    except SyntaxError:
        return class_source
    text = textwrap.dedent(class_source)
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == "forward":
                    lines = text.splitlines(keepends=True)
                    start = min([item.lineno] + [d.lineno for d in item.decorator_list]) - 1
                    return textwrap.dedent("".join(lines[start:item.end_lineno]))
    return class_source


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
    planner_stops: list[str] = field(default_factory=list)
    """Why planners stopped proposing (an API that kept failing, answers that could not be read)."""
    integration: IntegrationResult | None = None
    integration_error: str | None = None
    generated_at: float = field(default_factory=time.time)

    @property
    def gpu_seconds(self) -> float:
        return sum(t.gpu_seconds for t in self.history.trials)

    @property
    def unjailed(self) -> str | None:
        """A line when some trials' candidates ran outside the jail (--no-jail, or no jail here)."""
        ran = [t for t in self.history.trials if t.jail]
        out = [t for t in ran if t.jail != "bubblewrap"]
        if not out:
            return None
        planners = ", ".join(sorted({t.planner for t in out}))
        return (f"{len(out)} of {len(ran)} trials ran without the jail ({planners}): their candidates had your "
                "user's rights (--no-jail, or no jail on that machine; see agent doctor)")

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


def candidate_source(run: RunFolder, trial: Trial) -> tuple[str | None, Path | None, list[str]]:
    """(source, path, where it looked) of the file whose content hash is the trial's: the run's
    own copy first, then its recorded path (absolute, or relative to where tune ran). A file
    with other content is never taken for the candidate."""
    paths = [run.candidates_dir / f"{trial.candidate_hash}.py"]
    if trial.candidate_path:
        p = Path(trial.candidate_path)
        paths += [p] if p.is_absolute() else [Path.cwd() / p, run.path.parent / p, run.path.parent.parent / p]
    looked = []
    for p in dict.fromkeys(paths):
        looked.append(str(p))
        try:
            text = p.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        if hashlib.sha256(text.encode()).hexdigest()[:16] == trial.candidate_hash:
            return text, p, looked
    return None, None, looked


def _timing_kind(trial: Trial) -> str:
    if trial.timings:
        return "cpu" if all(w.timing_kind == "cpu" for w in trial.timings) else "cuda"
    return "cpu" if trial.device.partition(":")[0].partition("@")[0] == "cpu" else "cuda"


def collect(run: RunFolder) -> ReportData:
    """Everything the report shows, read from the run folder; the store is opened read-only
    (and not at all when the run has none yet). A damaged store is a `StoreError`."""
    problems = run.problems()
    history = History({p.name: p.target_generations for p in problems})
    usd, stop, planner_stops = 0.0, None, []
    if run.check_store():
        store = run.store(readonly=True)
        try:
            for trial in store.trials():
                history.add(trial)
            usd = store.llm_usd()
            last = store.last_event("stop")
            stop = last.get("reason") if last else None
            planner_stops = list(dict.fromkeys(e.get("reason", "") for e in store.events("planner_stopped")))
        finally:
            store.close()
    timing: dict[str, str] = {}
    for t in history.trials:  # a generation timed with CUDA events even once is a GPU
        if timing.get(t.generation) != "cuda":
            timing[t.generation] = _timing_kind(t)
    regions = []
    for p in problems:
        best = history.best(p.name)
        source, path, looked = (candidate_source(run, next(iter(best.by_generation.values())))
                                if best else (None, None, []))
        rejected: dict[str, list[Trial]] = {}
        for t in history.trials:
            if t.region == p.name and t.status.value != "ok":
                rejected.setdefault(t.status.value, []).append(t)
        regions.append(RegionView(p, history.targets(p.name), history.counts(p.name), len(history.kept(p.name)),
                                  best, rejected, source, path, looked))
    data = ReportData(run, run.info(), problems, history, regions, usd, stop, timing, planner_stops)
    try:
        data.integration = IntegrationResult.load(run.path)
    except (ValueError, OSError) as e:
        data.integration_error = f"integration.json could not be read: {str(e).splitlines()[0]}"
    if data.integration is None and data.integration_error is None and (why := last_failure(run.path)):
        data.integration_error = f"Integration gave no result: {why}"
    return data


def run_state(data: ReportData) -> str:
    """One sentence: stopped and why, or still going / killed."""
    return f"Stopped: {data.stop}." if data.stop else "No stop recorded: the run is still going (or was killed)."
