"""The jobs behind the CLI's commands: profile and freeze, try one candidate, tune a run.

Each returns values (or raises `UserError` with a one-line message); the CLI only parses
arguments, prints and sets the exit code.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from agent.budget import Budget
from agent.executors.local import LocalExecutor, parse_devices
from agent.loop import Outcome, load_history, tune
from agent.planners import PlannerError, make_planner
from sandbox.runner import Limits, TrialRunner
from tools.capture import MODEL_DIR, RegionChoice, freeze, freeze_model
from tools.devices import get_ceilings, software_versions
from tools.modelfile import file_sha256, load_model
from tools.problem import Problem, StopRule, Tolerance
from tools.profiler import ProfileResult, plan_regions, profile_model, select_regions
from tools.runfolder import RunFolder, RunInfo
from tools.trial import Candidate, Trial


class UserError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: CUDA is not available on this machine (use --device cpu)")
    if device.split(":")[0] not in ("cuda", "cpu"):
        raise UserError(f"--device {device!r}: use cuda, cuda:N or cpu")
    return torch.device(device)


@dataclass
class ProfileOutcome:
    run: RunFolder
    result: ProfileResult
    problems: list[Problem]
    skipped: dict[str, str]


def profile_and_freeze(model: Path, device: str | None, workload: str | None, runs_dir: Path, *,
                       tolerance: str | None = None, region_tolerance: list[str] = (),
                       stop_rule: StopRule | None = None, targets: list[str] | None = None,
                       coverage: float = 0.9, max_regions: int = 8, freeze_problems: bool = True,
                       regions: list[str] | None = None, e2e_tolerance: str | None = None) -> ProfileOutcome:
    dev = resolve_device(device)
    tol = _tolerance(tolerance) if tolerance else None
    e2e_tol = _tolerance(e2e_tolerance) if e2e_tolerance else None
    per_region = {}
    for item in region_tolerance:
        name, sep, text = item.partition("=")
        if not sep:
            raise UserError(f"--region-tolerance {item!r}: use CLASS=abs:1e-3 or CLASS=rel:1e-2")
        per_region[name] = _tolerance(text)
    loaded = load_model(model, dev, workload=workload)
    ceilings = get_ceilings(dev)
    run = RunFolder.create(runs_dir, loaded.path)
    result = profile_model(loaded, dev, workload, ceilings, trace_path=run.path / "trace.json",
                           hotspots_path=run.path / "hotspots.json")
    problems, skipped = [], {}
    if freeze_problems:
        rows = select_regions(result, coverage=coverage, max_regions=max_regions)
        if regions:  # the user's choice of classes overrides the coverage rule
            by_name = {r.class_name: r for r in result.by_class}
            unknown = [r for r in regions if r not in by_name]
            if unknown:
                raise UserError(f"--regions: no module class {', '.join(unknown)} in the model "
                                f"(has: {', '.join(sorted(by_name))})")
            rows = [by_name[r] for r in regions]
        choices = [RegionChoice(r.class_name, r.share, tuple(k.name for k in r.top_kernels),
                                _per_workload_ms(result, r.qualname)) for r in rows]
        problems, skips = freeze(loaded, choices, run.problems_dir, dev, tolerance=tol, per_region=per_region,
                                 stop_rule=stop_rule, targets=targets, device_name=result.device_name,
                                 ceilings=ceilings.model_dump())
        skipped = {s.class_name: s.reason for s in skips}
        if not problems:  # issue 14: say why for every class the profile saw, not an empty list
            skipped.update({v.class_name: f"not chosen: {v.reason}" for v in plan_regions(result, coverage, max_regions)
                            if not v.chosen and v.class_name not in skipped})
        try:  # the whole model's end-to-end reference, for integration
            freeze_model(loaded, run.path / MODEL_DIR, dev, e2e_tol, device_name=result.device_name)
        except ValueError as e:
            skipped["(whole model)"] = f"no end-to-end reference: {e}"
    run.write_info(RunInfo(run_id=run.run_id, model_file=str(loaded.path), model_hash=loaded.file_hash,
                           device=dev.type, versions={k: str(v) for k, v in software_versions().items()},
                           options={"workload": workload, "stop_rule": (stop_rule or StopRule()).model_dump()},
                           skipped=skipped))
    return ProfileOutcome(run, result, problems, skipped)


def _per_workload_ms(result: ProfileResult, qualname: str) -> dict[str, float]:
    out = {}
    for w in result.workloads:
        row = next((c for c in w.by_class if c.qualname == qualname), None)
        if row is not None and row.calls:
            out[w.name] = row.inclusive_ms / row.calls
    return out


def _tolerance(text: str) -> Tolerance:
    try:
        return Tolerance.parse(text)
    except ValueError as e:
        raise UserError(str(e).splitlines()[0]) from None


def find_problem(target: Path, region: str | None) -> Path:
    """A problem folder from a problem path, or a run folder plus --region (or its only problem)."""
    target = Path(target)
    if (target / "problem.json").is_file():
        return target
    if not (target / "run.json").is_file():
        raise UserError(f"{target}: neither a run folder nor a problem folder")
    names = [p.name for p in RunFolder(target).problems()]
    if region:
        if region not in names:
            raise UserError(f"{target}: no problem {region!r} (has: {', '.join(names) or 'none'})")
        return target / "problems" / region
    if len(names) != 1:
        raise UserError(f"{target} has problems {', '.join(names) or '(none)'}: choose one with --region")
    return target / "problems" / names[0]


def try_candidate(target: Path, candidate: Path, region: str | None, device: str | None,
                  record: bool = True) -> Trial:
    folder = find_problem(target, region)
    if not candidate.is_file():
        raise UserError(f"{candidate}: candidate file not found")
    problem = Problem.load(folder)
    check_model_unchanged(problem)
    dev = resolve_device(device or problem.device)
    runner = TrialRunner(str(dev) if dev.type == "cpu" else f"cuda:{dev.index or 0}", Limits())
    try:
        runner.add_problem(folder)
        c = Candidate(region=problem.name, source=candidate.read_text(), planner="manual", note=candidate.name)
        run = RunFolder(folder.parent.parent) if (folder.parent.parent / "run.json").is_file() else None
        path = str(run.save_candidate(c.source, c.hash)) if run and record else str(candidate)
        trial = runner.run(c, candidate_path=path)
    finally:
        runner.close()
    if run is not None and record:
        store = run.store()
        store.record(trial)
        store.close()
    return trial


def _recorder(run: RunFolder) -> Callable[..., None]:
    """Where planners note LLM calls, their cost, and answers that could not be read. Opens
    the store per call: planners run in their own thread, and SQLite connections do not move."""
    def record(kind: str, region: str = "", reply=None, error: str = "", raw: str = "") -> None:
        store = run.store()
        try:
            if kind == "llm_call":
                store.record_llm_call(reply, purpose=f"propose {region}")
            elif kind == "llm_error":
                store.record_llm_call({"ok": False, "error": error, "purpose": f"propose {region}"})
            else:
                store.event(kind, region=region, error=error, raw=raw)
        finally:
            store.close()
    return record


def _usd(run: RunFolder) -> float:
    store = run.store()
    try:
        return store.llm_usd()
    finally:
        store.close()


def check_model_unchanged(problem: Problem) -> None:
    path = Path(problem.model_file)
    if not path.is_file():
        raise UserError(f"{path}: the model file of this problem is gone")
    if file_sha256(path) != problem.model_hash:
        raise UserError(f"{path} changed since problem {problem.name} was frozen (hash mismatch): "
                        "profile again to freeze new problems")


def check_planner(spec: str, llm_model: str | None = None, base_url: str | None = None) -> None:
    """Fail before profiling when the planner cannot work (unknown name, missing API key)."""
    try:
        make_planner(spec, llm_model=llm_model, base_url=base_url)
    except PlannerError as e:
        raise UserError(str(e)) from None


def run_tune(run: RunFolder, planner_spec: str, devices: str | None, stop_rule: StopRule,
             on_trial: Callable[[Trial], None] = lambda t: None, limits: Limits | None = None,
             on_note: Callable[[str], None] = lambda note: None,
             llm_model: str | None = None, base_url: str | None = None,
             memory_gb: float = 8.0, executor_name: str = "local",
             ray_address: str | None = None, workers_per_gpu: int | None = None) -> tuple[Outcome, Budget]:
    problems = run.problems()
    if not problems:
        raise UserError(f"{run.path}: no frozen problems to tune (see skipped regions in run.json)")
    for p in problems:
        check_model_unchanged(p)
    check_executor(executor_name, devices, ray_address)
    if executor_name == "ray":
        executor = _ray_executor(run, problems, ray_address, limits or Limits(budget_ms=150), memory_gb,
                                 workers_per_gpu)
        slots, notes, generations = [], [executor.describe()], executor.generations
    else:
        try:
            slots, notes = parse_devices(devices)
        except ValueError as e:
            raise UserError(str(e)) from None
        executor, generations = None, sorted({s.generation for s in slots})
    try:
        planner = make_planner(planner_spec, inbox=run.inbox, llm_model=llm_model, base_url=base_url,
                               max_usd=stop_rule.max_usd, record=_recorder(run), usd_spent=lambda: _usd(run),
                               device=", ".join(generations))
    except (PlannerError, ValueError) as e:
        if executor is not None:
            executor.close()
        raise UserError(str(e)) from None
    for note in notes:
        on_note(note)
    if any(s.device == "cpu" for s in slots) and any(p.device != "cpu" for p in problems):
        on_note("the problems were frozen on a GPU but trials run on the CPU: CPU timings, and the "
                "reference outputs come from another device")
    if executor is None:
        executor = LocalExecutor(slots, [run.problems_dir / p.name for p in problems],
                                 limits or Limits(budget_ms=150), memory_gb=memory_gb,
                                 workers_per_device=workers_per_gpu)
    history = load_history(run, problems, executor.generations)
    store = run.store()
    budget = Budget(stop_rule, spent_seconds=store.gpu_seconds(), candidates_tried=len(history.records))
    store.close()
    stop = threading.Event()
    previous = signal.getsignal(signal.SIGINT)

    def interrupt(signum, frame):  # first Ctrl-C: finish cleanly; second: the default
        stop.set()
        signal.signal(signal.SIGINT, previous)
        if hasattr(executor, "interrupt"):  # Ray: the run loop tells the actors
            executor.interrupt()
        else:
            for r in executor.runners:
                r.worker.kill()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, interrupt)
    try:
        outcome = tune(run, problems, planner, executor, budget, history, on_trial, stop.is_set)
    except ValueError as e:  # ClusterError: the Ray cluster lost every worker of a target generation
        if type(e).__name__ != "ClusterError":
            raise
        raise UserError(f"{str(e).splitlines()[0]}; continue with: agent tune --resume {run.path} "
                        "--executor ray") from None
    finally:
        executor.close()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, previous)
    if stop.is_set():
        outcome.stop_reason = "interrupted (Ctrl-C)"
    return outcome, budget


EXECUTORS = ("local", "ray")


def check_executor(name: str, devices: str | None = None, ray_address: str | None = None) -> None:
    """Fail before profiling when the executor cannot work (unknown name, Ray not installed)."""
    if name not in EXECUTORS:
        raise UserError(f"--executor {name!r}: use {' or '.join(EXECUTORS)}")
    if ray_address and name != "ray":
        raise UserError("--ray-address needs --executor ray")
    if name == "ray":
        if devices:
            raise UserError("--devices is for --executor local; with --executor ray the cluster's GPUs "
                            "(or its gen:LABEL resources) are the devices")
        try:
            import ray  # noqa: F401
        except ImportError:
            raise UserError("--executor ray needs Ray: pip install 'nightshift[ray]'") from None


def _ray_executor(run: RunFolder, problems: list[Problem], address: str | None, limits: Limits,
                  memory_gb: float, workers_per_gpu: int | None = None):
    from agent.executors.ray import RayExecutor  # imports Ray itself only now
    targets = sorted({g for p in problems for g in p.target_generations}) or None
    try:
        return RayExecutor([run.problems_dir / p.name for p in problems], address=address, targets=targets,
                           limits=limits, memory_gb=memory_gb, workers_per_device=workers_per_gpu)
    except ValueError as e:  # ClusterError: a target generation without workers
        raise UserError(str(e).splitlines()[0]) from None
    except (ConnectionError, RuntimeError) as e:
        raise UserError(f"--ray-address {address or '(local)'}: cannot start or join the Ray cluster: "
                        f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None
