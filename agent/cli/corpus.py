"""`agent tune --model a.py --model b.py ...` (or `--models DIR`): a corpus, start to end.

    refuse bad input              every model file and flag checked before anything is profiled
    profile and freeze each model into runs/<corpus>/models/<run>/ (a model that cannot be frozen
                                  is said so, and the others go on)
    group the problem classes     tools/classes.py, once every model is frozen; fixed from then on
    each model in turn            its search under its share of the budget (agent/search/corpus.py),
                                  a class searched on its leader only, its winners verified on every
                                  member (agent/planners/shared.py); then its integration and report,
                                  as a single run's (agent/cli/session.py)
    the corpus report             agent/report/corpus_view.py

corpus.json records each step as it ends: `--resume` freezes what was not frozen, skips a model
searched and integrated under a cap as large as its cap now, and resumes the others from their
stores (no finished trial runs again). Exit codes as `agent tune`'s; 2 where a model could not be frozen
(the others were tuned).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, TextIO

from agent.errors import UserError
from agent.flags import check_freeze_flags
from agent.report.corpus_view import write_corpus_report
from agent.search.corpus import class_planner, classify, model_rule, unique_names
from agent.search.settings import SETTINGS_KEY, TuneSettings, resolve
from agent.search.signals import signals_as_interrupts
from agent.cli.session import INTERRUPTED, TuneRequest, TuneResult, _check_search, drop_spares, search_and_review
from tools.corpus import CorpusFolder, CorpusModel
from tools.modelfile import ModelFileError
from tools.problem import ProblemError

BAD_INPUT = 2
FREEZE_OPTIONS = ("device", "workload", "tolerance", "region_tolerance", "e2e_tolerance", "max_regions", "regions",
                  "trace", "trace_keep_own")
"""What a corpus's models are profiled and frozen with, kept in corpus.json for a resume."""


@dataclass
class CorpusRequest:
    tune: TuneRequest
    """Everything a single tune takes (its `model` and `resume` unused)."""
    models: list[Path] = field(default_factory=list)
    weights: dict[str, float] = field(default_factory=dict)
    """--model-weight NAME=W: how much a model's time counts in the budget's split."""
    resume: Path | None = None


@dataclass
class CorpusResult:
    folder: CorpusFolder
    results: dict[str, TuneResult | str] = field(default_factory=dict)
    """Model name -> its tune, or why it has none."""
    report: Path | None = None
    exit_code: int = 0
    error: str = ""

    def summary(self) -> dict:
        info = self.folder.info()
        return {"corpus": str(self.folder.path), "report": str(self.report) if self.report else None,
                "exit_code": self.exit_code, "error": self.error or None,
                "models": [{"name": m.name, "file": m.file, "run": str(self.folder.models_dir / m.run) if m.run else None,
                            "state": m.state, "reason": m.reason or None,
                            "tune": r.summary() if isinstance(r := self.results.get(m.name), TuneResult) else r}
                           for m in info.models],
                "classes": [{"members": [f"{a}/{b}" for a, b in c.members], "share": c.share}
                            for c in info.classes or []]}


def corpus_session(req: CorpusRequest, *, say: Callable[[str], None] = lambda text: None,
                   warn: Callable[[str], None] = lambda text: None, lines: TextIO | None = None,
                   console=None) -> CorpusResult:
    with signals_as_interrupts():
        folder, settings, notes = _start(req)
        lock = folder.lock().acquire()
        try:
            for text in notes:
                warn(text)
            result = CorpusResult(folder)
            try:
                _freeze_all(folder, settings, say)
                _classes(folder, say)
                _tune_each(folder, req, settings, result, say, warn, lines, console)
            except KeyboardInterrupt as e:  # while a model was profiled: what was frozen stays for a resume
                warn(f"interrupted ({str(e) or 'Ctrl-C'})")
                result.exit_code = INTERRUPTED
            result.report = write_corpus_report(folder)
            failed = [m for m in folder.info().models if m.state == "failed"]
            if failed and result.exit_code != INTERRUPTED:
                result.exit_code = BAD_INPUT
                result.error = "; ".join(f"{m.file} could not be tuned: {m.reason}" for m in failed) + \
                    f" (the other models were; fix it and run agent tune --resume {folder.path})"
            return result
        finally:
            lock.release()
            drop_spares()


def _start(req: CorpusRequest) -> tuple[CorpusFolder, TuneSettings, list[str]]:
    """A new corpus folder, or the one to resume, with the settings of this session."""
    t = req.tune
    if req.resume is not None:
        folder = CorpusFolder.open(req.resume)
        options = folder.info().options
        previous = TuneSettings.model_validate(options[SETTINGS_KEY]) if SETTINGS_KEY in options else None
        settings, notes = resolve(previous, t.given)
        _check_search(settings)
        info = folder.info()
        info.options[SETTINGS_KEY] = settings.model_dump()
        folder.write(info)
        return folder, settings, notes
    if len(req.models) < 2:
        raise UserError("a corpus needs two model files or more (--model A --model B, or --models DIR)")
    settings, notes = resolve(None, t.given)
    _check_search(settings)
    for model in req.models:
        check_freeze_flags(model, t.runs_dir, tolerance=t.tolerance, e2e_tolerance=t.e2e_tolerance,
                           region_tolerance=t.region_tolerance, max_regions=t.max_regions)
    names = unique_names([m.stem for m in req.models])
    if unknown := sorted(set(req.weights) - set(names)):
        raise UserError(f"--model-weight: no model named {', '.join(unknown)} (the models: {', '.join(names)})")
    models = [CorpusModel(name=n, file=str(m.resolve()), weight=req.weights.get(n, 1.0)) for n, m in zip(names, req.models)]
    request = {k: (str(v) if isinstance(v, Path) else v) for k in FREEZE_OPTIONS if (v := getattr(t, k)) is not None}
    folder = CorpusFolder.create(t.runs_dir, models, {SETTINGS_KEY: settings.model_dump(), "request": request})
    return folder, settings, notes


def _freeze_all(folder: CorpusFolder, settings: TuneSettings, say: Callable[[str], None]) -> None:
    """Profile and freeze every model not frozen yet; a model that cannot be is `failed`, with why."""
    from agent.setup.jobs import profile_and_freeze  # torch: only once the flags are known good
    info = folder.info()
    request = info.options.get("request", {})
    known = {m.run for m in info.models if m.run}
    for stale in [d for d in folder.models_dir.iterdir() if d.is_dir() and d.name not in known]:
        shutil.rmtree(stale, ignore_errors=True)  # half-made by a tuner killed while it froze
    for model in info.models:
        if model.state not in ("pending", "failed"):
            continue
        say(f"profiling and freezing {model.name} ({model.file})")
        try:
            res = profile_and_freeze(Path(model.file), request.get("device", "auto"), request.get("workload"),
                                     folder.models_dir, tolerance=request.get("tolerance"),
                                     stop_rule=settings.stop_rule, max_regions=request.get("max_regions", 8),
                                     regions=request.get("regions"), region_tolerance=request.get("region_tolerance", []),
                                     e2e_tolerance=request.get("e2e_tolerance"),
                                     trace=Path(request["trace"]) if request.get("trace") else None,
                                     trace_keep_own=request.get("trace_keep_own", False))
            model.run, model.state, model.reason = res.run.path.name, "frozen", ""
            say(f"  {model.name}: froze {', '.join(p.name for p in res.problems) or 'nothing'}")
        except (UserError, ModelFileError, ProblemError, ValueError) as e:
            model.state, model.reason = "failed", " ".join(str(e).split())
            say(f"  {model.name}: could not be frozen: {model.reason}")
        folder.write(info)
        folder.log(f"{model.name}: {model.state} {model.reason}".strip())


def _classes(folder: CorpusFolder, say: Callable[[str], None]) -> None:
    """Group the frozen problems into classes, once: a resume keeps the classes it started with."""
    info = folder.info()
    if info.classes is None:
        weights = {m.name: m.weight for m in info.models}
        info.classes = classify(folder.runs(), weights)
        folder.write(info)
    shared = [c for c in info.classes if len(c.members) > 1]
    say(f"{len(info.classes)} problem classes, {len(shared)} shared by several regions"
        + "".join(f"\n  {c.members[0][1]}: " + ", ".join(f"{m}/{r}" for m, r in c.members) for c in shared))


def _tune_each(folder: CorpusFolder, req: CorpusRequest, settings: TuneSettings, result: CorpusResult,
               say, warn, lines, console) -> None:
    """Each frozen model's search, integration and report, in corpus order (a class's leader comes
    first: its winners are final before a member's search starts); stops at an interrupt."""
    info = folder.info()
    runs = folder.runs()
    for i, model in enumerate(info.models, 1):
        if model.state not in ("frozen", "done"):
            result.results[model.name] = model.reason or model.state
            continue
        rule = model_rule(info, model.name, runs, settings.stop_rule)
        if model.state == "done" and model.cap_hours is not None and model.cap_hours >= rule.gpu_hours - 1e-9:
            result.results[model.name] = "searched and integrated in an earlier session"
            continue
        say(f"\nmodel {i}/{len(info.models)} {model.name}: {rule.gpu_hours:.4f} h, {rule.max_candidates} candidates")
        tune_req = replace(req.tune, model=None, resume=None, wrap=class_planner(info, model.name, runs))
        run = runs[model.name]
        lock = run.lock().acquire()
        try:
            res = search_and_review(tune_req, run, settings.model_copy(update={"stop_rule": rule}), [], say, warn,
                                    lines, console)
        except UserError as e:  # nothing frozen for it, say: the others go on
            result.results[model.name] = model.reason = str(e)
            model.state, model.cap_hours = "done", rule.gpu_hours
            folder.write(info)
            continue
        finally:
            lock.release()
        result.results[model.name] = res
        if res.interrupted:
            result.exit_code = INTERRUPTED
            return
        model.state, model.cap_hours = "done", rule.gpu_hours
        model.reason = res.integration if isinstance(res.integration, str) else ""
        folder.write(info)
        folder.log(f"{model.name}: searched ({res.outcome.stop_reason}), {res.outcome.trials_run} trials")


def corpus_status(path: Path) -> tuple[dict, list[str]]:
    """`agent status CORPUS`: whether a tuner holds the corpus, and per model its state, its run
    and that run's status (agent/cli/view.py); (what --json prints, the lines printed)."""
    from agent.cli.view import status_of
    from tools.runfolder import lock_holder
    folder = CorpusFolder.open(path)
    info = folder.info()
    pid, holder = lock_holder(folder)  # it reads only the folder's tune.lock
    models, lines = [], [f"{folder.path}: " + (f"running now ({holder})" if pid else "no tuner is running")]
    for m in info.models:
        row = {"name": m.name, "file": m.file, "state": m.state, "reason": m.reason or None, "run": None}
        line = f"  {m.name}: {m.state}" + (f" ({m.reason})" if m.reason else "")
        if m.run:
            data, budget = status_of(folder.run_of(m))
            row.update(run=data["run"], status=data)
            trials = sum(r["trials"] for r in data["regions"])
            line += f", run {data['run']}: {data['text']}; {trials} trials; {budget}"
        models.append(row)
        lines.append(line)
    shared = [c for c in info.classes or [] if len(c.members) > 1]
    if info.classes is not None:
        lines.append(f"{len(info.classes)} problem classes, {len(shared)} shared: "
                     + "; ".join(", ".join(f"{a}/{b}" for a, b in c.members) for c in shared))
    return {"corpus": str(folder.path), "running": pid is not None, "models": models,
            "classes": [c.model_dump() for c in info.classes or []]}, lines
