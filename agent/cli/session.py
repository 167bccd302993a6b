"""`agent tune`, start to end: one tuner per run, settings kept across resumes, progress a
person can follow with or without a terminal, then integration and the report.

    refuse bad settings           before anything is profiled or touched
    profile and freeze (new run)  or open the run (--resume): its store must read, its lock be free
    hold the run's lock           a second tuner on the run is refused in one line
    search                        agent/search/tuning.py; progress to the terminal and runs/<run>/log.txt
    integrate, report             unless interrupted; the report is written even then

SIGTERM and SIGHUP are treated like Ctrl-C throughout: during the search they stop it cleanly
(agent/search/tuning.py); before it (profiling) they interrupt like Ctrl-C, and the half-made run
folder is removed. Exit codes: 0 done; 1 the search could not run (no planner proposed
anything, every planner failed); 130 interrupted.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

from agent import report
from agent.errors import UserError
from agent.flags import check_freeze_flags
from agent.history import History
from agent.history import load_history
from agent.search.loop import Outcome
from agent.cli.progress import Progress
from agent.search.settings import SETTINGS_KEY, TuneSettings, recorded, resolve
from agent.search.signals import signals_as_interrupts
from agent.search.tuning import check_executor, check_planner, run_tune
from tools.problem import ProblemError
from tools.runfolder import RunFolder, clean_stale_worker_dirs
from tools.screen import summary as screen_summary

INTERRUPTED = 130
SEARCH_FAILED = 1


def drop_spares() -> None:
    """Workers started ahead that no pool took end (sandbox/client.py; imported here, not at the
    top: it imports torch, and a bad flag is answered before that second)."""
    from sandbox.client import drop_spares as drop
    drop()


@dataclass
class TuneRequest:
    """What `agent tune` was asked; `given` holds the settings flags, None where not given."""
    model: Path | None = None
    resume: Path | None = None
    given: dict[str, Any] = field(default_factory=dict)
    device: str = "auto"
    workload: str | None = None
    tolerance: str | None = None
    region_tolerance: list[str] = field(default_factory=list)
    e2e_tolerance: str | None = None
    max_regions: int = 8
    regions: list[str] | None = None
    runs_dir: Path = Path("runs")
    integrate: bool = True
    baselines: bool | None = None
    trace: Path | None = None
    """--workloads TRACE.jsonl: the workload mix from a request trace (tools/traffic.py)."""
    trace_keep_own: bool = False
    """--model-workloads: with a trace, the model's own workloads too, at weight 0."""
    compile_modes: list[str] | None = None
    """--compile-modes: the compile baselines (and the ways with our kernels inside them); None: all."""
    wrap: Callable[[Any], Any] | None = None
    """The planner the search asks around the settings' one (a corpus's class planner); None: that one."""


@dataclass
class TuneResult:
    run: RunFolder
    settings: TuneSettings
    outcome: Outcome
    gpu_seconds: float
    timing_kind: str
    report: Path | None
    integration: Any = None
    exit_code: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def interrupted(self) -> bool:
        return self.exit_code == INTERRUPTED

    def summary(self) -> dict:
        from agent.report.integration_view import summary as integration_summary
        data = {"run": str(self.run.path), "stop_reason": self.outcome.stop_reason, "trials": self.outcome.trials_run,
                "plans": self.outcome.plans, "best_speedup": self.outcome.best,
                "report": str(self.report) if self.report else None, "gpu_seconds": self.gpu_seconds,
                "timing_kind": self.timing_kind, "exit_code": self.exit_code, "log": str(self.run.log_path),
                "planner_failure": self.outcome.planner_failure or None, "notes": self.notes,
                "settings": self.settings.model_dump()}
        data["integration"] = self.integration if self.integration is None or isinstance(self.integration, str) \
            else integration_summary(self.integration)
        return data


def tune_session(req: TuneRequest, *, say: Callable[[str], None] = lambda text: None,
                 warn: Callable[[str], None] = lambda text: None, lines: TextIO | None = None,
                 console=None) -> TuneResult:
    """Run `agent tune`. `say` gets what the user reads on stdout, `warn` the notes for stderr;
    `lines` is the stream for line-oriented progress and `console` a rich Console for the live
    table (either may be None)."""
    if (req.model is None) == (req.resume is None):
        raise UserError("give either --model FILE (a new run) or --resume RUN (continue one)")
    with signals_as_interrupts():
        if req.model is not None:
            settings, notes = resolve(None, req.given)
            _check_search(settings)
            check_freeze_flags(req.model, req.runs_dir, tolerance=req.tolerance, e2e_tolerance=req.e2e_tolerance,
                               region_tolerance=req.region_tolerance, max_regions=req.max_regions)
            from agent.setup.jobs import profile_and_freeze  # torch: only once the flags are known good
            try:
                res = profile_and_freeze(req.model, req.device, req.workload, req.runs_dir, tolerance=req.tolerance,
                                         stop_rule=settings.stop_rule, max_regions=req.max_regions,
                                         regions=req.regions, region_tolerance=req.region_tolerance,
                                         e2e_tolerance=req.e2e_tolerance, trace=req.trace,
                                         trace_keep_own=req.trace_keep_own, on_run=_prestart(settings, notes))
            except BaseException:  # no search will take the workers started for it
                drop_spares()
                raise
            run = res.run
            say(f"run folder {run.path}: froze {', '.join(p.name for p in res.problems) or 'nothing'}")
            for p in res.problems:
                if p.constant_output is not None:
                    warn(f"{p.name}: every output element is {p.constant_output:g} on its frozen inputs; a candidate "
                         "that skips the work is correct there, and its trials are flagged")
            if not res.problems:  # the reasons here, not only in run.json
                for name, why in res.skipped.items():
                    say(f"  skipped {name}: {why}")
            lock = run.lock().acquire()
        else:  # everything is checked before the run is touched (its lock file included)
            run = RunFolder.open(req.resume)
            has_store = run.check_store()
            previous = recorded(run.info().options, has_store or run.tried_candidates() > 0)
            settings, notes = resolve(previous, req.given)
            _check_search(settings)
            lock = run.lock().acquire()
            if lock.took_over:
                notes.append(f"took over the run from a tuner that is no longer running ({lock.took_over})")
        try:
            return search_and_review(req, run, settings, notes, say, warn, lines, console)
        finally:
            lock.release()
            drop_spares()


def _prestart(settings: TuneSettings, notes: list[str]) -> Callable[[RunFolder, str], None]:
    """Start the search's workers once the run folder exists, while the model is profiled and
    frozen (a worker's start was 30 of the 41 s to the first trial on the H200); the search's
    pools adopt them (sandbox/client.py `prestart`), and `drop_spares` ends any left over."""
    def start(run: RunFolder, model_file: str) -> None:
        if settings.executor != "local":
            return
        from agent.executors.local import spare_configs
        from sandbox.client import prestart
        try:
            prestart(spare_configs(settings.devices, run.path, model_file,
                                   workers_per_device=settings.workers_per_gpu or None))
        except (ValueError, OSError) as e:  # the search starts its own
            notes.append(f"workers not started ahead of the search: {e}")
    return start


def _check_search(settings: TuneSettings) -> None:
    check_planner(settings.planner, settings.llm_model, settings.base_url)
    check_executor(settings.executor, settings.devices, settings.ray_address)
    if settings.devices and settings.executor == "local":
        from agent.executors.local import parse_devices
        try:
            slots, _ = parse_devices(settings.devices)
        except ValueError as e:
            raise UserError(f"--devices {settings.devices!r}: {e}") from None
        if not slots:
            raise UserError(f"--devices {settings.devices!r}: no device given (cpu, cuda:0, cpu@a,cpu@b, ...)")


def search_and_review(req: TuneRequest, run: RunFolder, settings: TuneSettings, notes: list[str], say, warn,
                       lines, console) -> TuneResult:
    run.update_options(**{SETTINGS_KEY: settings.model_dump(), "stop_rule": settings.stop_rule.model_dump()})
    problems = run.problems()
    if not problems:
        raise UserError(f"{run.path}: no frozen problems to tune (see skipped regions in run.json)")
    kind = _timing_kind(problems, settings.devices)
    seen = History()
    for t in load_history(run, problems, settings.generations).trials:
        seen.add(t)
    rule = settings.stop_rule
    progress = Progress(run.log_path, problems, seen, kind, rule.max_candidates, rule.gpu_hours,
                        lines=lines, console=console)

    def note(text: str) -> None:
        notes.append(text)
        progress.note(text)
        warn(text)

    progress.start(f"session start: {run.path}, planner {settings.planner}, devices {settings.devices or 'auto'}, "
                   f"caps {rule.gpu_hours:g} h, {rule.max_candidates} candidates, patience {rule.patience}")
    for text in list(notes):
        progress.note(text)
        warn(text)
    removed = clean_stale_worker_dirs()
    if removed:
        note(f"removed {removed} sandbox temp folder(s) left by tuners that were killed")

    def on_trial(trial) -> None:
        seen.add(trial)
        progress.trial(trial)
        first_trial.set()

    outcome, budget, interrupted = None, None, False
    first_trial = threading.Event()
    early = _early_baselines(run, settings.devices, req, note, lambda line: progress.write(f"integration: {line}"),
                             first_trial)
    try:
        outcome, budget = run_tune(run, settings.planner, settings.devices, rule, on_trial=on_trial, on_note=note,
                                   llm_model=settings.llm_model, base_url=settings.base_url,
                                   executor_name=settings.executor, ray_address=settings.ray_address,
                                   workers_per_gpu=settings.workers_per_gpu or None, on_budget=progress.set_budget,
                                   on_in_flight=lambda f: setattr(progress, "in_flight", _with(f, early)),
                                   screen=settings.screen if settings.screen is not None else kind != "cpu",
                                   wrap=req.wrap or (lambda planner: planner))
    except KeyboardInterrupt as e:  # a second signal during the search, or one before its own handlers
        interrupted = True
        outcome = Outcome(f"interrupted ({str(e) or 'Ctrl-C'})", 0, 0)
    except BaseException:
        if early is not None:
            early.close()
        raise
    finally:
        drop_spares()  # workers started ahead that no pool took (the devices were busy, say)
        if outcome is None:
            progress.close("session ended with an error")
    interrupted = interrupted or outcome.stop_reason.startswith("interrupted")
    if screened := screen_summary(seen.trials):  # what the screen dropped, and its measured misses
        note(screened)
    if outcome.generations:
        settings.generations = outcome.generations
        run.update_options(**{SETTINGS_KEY: settings.model_dump()})
    integration = None
    first_trial.set()  # a search that tried nothing new: the baselines wait no longer
    try:
        if req.integrate and not interrupted and seen.trials:
            progress.phase("integrating: the winners routed into the model and verified end to end, then every way "
                           "of running it (eager, CUDA graph, each torch.compile mode with and without our kernels) "
                           "compiled side by side and timed one by one")
            integration = _integrate(run, settings.devices, req.baselines, note,
                                     lambda line: progress.write(f"integration: {line}"),
                                     lambda f: setattr(progress, "in_flight", f), early, req.compile_modes)
    except KeyboardInterrupt:
        interrupted = True
        note("integration interrupted: the search's results are kept; run agent integrate RUN later")
    finally:
        if early is not None:
            early.close()
    report_path, cut = write_report(run, note)
    interrupted = interrupted or cut
    code = INTERRUPTED if interrupted else SEARCH_FAILED if (outcome.planner_failure or not seen.trials) else 0
    if code == SEARCH_FAILED and not outcome.planner_failure:
        outcome.planner_failure = f"no candidate could be tried ({outcome.stop_reason})"
    clean_stale_worker_dirs()  # what a tuner killed shortly before this session left
    progress.close(f"stopped: {outcome.stop_reason}. report: {report_path}. continue with: agent tune --resume "
                   f"{run.path}")
    spent = budget.spent if budget else sum(t.gpu_seconds for t in seen.trials)
    return TuneResult(run, settings, outcome, spent, kind, report_path, integration, code, notes)


def write_report(run: RunFolder, note: Callable[[str], None]) -> tuple[Path | None, bool]:
    """(report.md, or None where it could not be written; whether a signal cut it short). The
    results are all in the store: an interrupted report ends the run as any interrupted one."""
    try:
        return report.write(run), False
    except (OSError, ProblemError) as e:
        note(f"the report could not be written: {e}")
    except KeyboardInterrupt:
        note(f"the report was interrupted; agent report {run.path} writes it")
        return None, True
    return None, False


def _timing_kind(problems, devices: str | None) -> str:
    on_cpu = all(d.partition("@")[0].strip() == "cpu" for d in (devices or "cpu").split(",") if d.strip())
    return "cpu" if all(p.device == "cpu" for p in problems) and on_cpu else "cuda"  # cpu@a,cpu@b is the CPU too


def _with(in_flight: Callable[[], list[str]], early) -> Callable[[], list[str]]:
    """The live view's 'now:' of the search, and of the compile baselines running beside it."""
    return in_flight if early is None else lambda: in_flight() + early.in_flight()


def _integration_device(run: RunFolder, devices: str | None, baselines: bool | None) -> tuple[str | None, bool, bool]:
    """Where integration runs (the first device asked for), whether that is a GPU, and whether
    it times the compile baselines (by default on a GPU only)."""
    device = (devices or "").split(",")[0].partition("@")[0].strip() or None
    on_gpu = (device or "").startswith("cuda") or (not device and cuda_run(run))
    return device, on_gpu, on_gpu if baselines is None else baselines


def _early_baselines(run: RunFolder, devices: str | None, req: TuneRequest, note: Callable[[str], None],
                     on_step: Callable[[str], None], first_trial: threading.Event):
    """The compile baselines started beside the search (agent/review/early_baselines.py) once its first
    trial ends, on a GPU when integration will time them; None otherwise, or when they cannot
    start (integration then runs them itself)."""
    device, on_gpu, want = _integration_device(run, devices, req.baselines)
    if not (req.integrate and on_gpu and want):
        return None
    from agent.review.early_baselines import EarlyBaselines
    try:
        early = EarlyBaselines(run, device, modes=req.compile_modes, on_step=on_step)
    except (UserError, ProblemError, OSError) as e:
        note(f"compile baselines not started beside the search: {e}")
        return None
    on_step("every torch.compile mode of the untouched model compiles beside the search from its first trial on")
    return early.start(after=first_trial)


def _integrate(run: RunFolder, devices: str | None, baselines: bool | None, note: Callable[[str], None],
               on_step: Callable[[str], None] = lambda line: None, on_in_flight=lambda f: None, early=None,
               modes: list[str] | None = None):
    """Integration after a search: the result, or one line saying why there is none (a search
    that found something must not end in a traceback because the end-to-end check could not run)."""
    from agent.review.integrate import IntegrationError, integrate
    device, _, want = _integration_device(run, devices, baselines)
    try:
        return integrate(run, device, baselines=want, on_step=on_step, on_in_flight=on_in_flight,
                         early=early, modes=modes)  # its notes are part of the result
    except (IntegrationError, UserError, ProblemError) as e:
        note(f"integration: {e}")
        return f"not integrated: {e}"


def cuda_run(run: RunFolder) -> bool:
    """The run's whole-model reference was frozen on a GPU that is here."""
    try:
        import torch

        from tools.capture_model import MODEL_DIR
        from tools.problem import Problem
        return Problem.load(run.path / MODEL_DIR).device == "cuda" and torch.cuda.is_available()
    except Exception:
        return False
