"""One tune session's search: the planner and executor built from the run's settings, the
budget picked up where the run left it, and signals that stop it cleanly.

SIGINT (Ctrl-C), SIGTERM and SIGHUP all stop the search the same way: trials in flight are cut
short (not results: a resume runs them again), a stop event goes to the store, and the caller
writes the report and prints the resume command. A second signal leaves the search at once
(agent/search/signals.py: it raises KeyboardInterrupt, and any after it is ignored).
Under `nohup` SIGHUP stays ignored, as nohup asked.
"""

from __future__ import annotations

import signal
import threading
from typing import TYPE_CHECKING, Callable

from agent.search.budget import Budget
from agent.errors import UserError
from agent.history import load_history
from agent.search.loop import Outcome, tune
from agent.planners import Planner, PlannerError, make_planner, planner_names
from agent.search.signals import STOP_SIGNALS, detach_from_terminal, is_stopping
from tools.problem import Problem, StopRule
from tools.runfolder import RunFolder
from tools.trial import Trial

if TYPE_CHECKING:
    from sandbox.runner import Limits


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


def check_planner(spec: str, llm_model: str | None = None, base_url: str | None = None) -> None:
    """Fail before profiling when the planner cannot work (unknown name, missing API key)."""
    try:
        llms = [n for n in planner_names(spec) if n in ("anthropic", "openai")]  # the others need nothing
        if llms:
            make_planner(",".join(llms), llm_model=llm_model, base_url=base_url)
    except PlannerError as e:
        raise UserError(str(e)) from None


def run_tune(run: RunFolder, planner_spec: str, devices: str | None, stop_rule: StopRule,
             on_trial: Callable[[Trial], None] = lambda t: None, limits: Limits | None = None,
             on_note: Callable[[str], None] = lambda note: None,
             llm_model: str | None = None, base_url: str | None = None,
             memory_gb: float = 8.0, executor_name: str = "local",
             ray_address: str | None = None, workers_per_gpu: int | None = None,
             on_budget: Callable[[Budget], None] = lambda b: None,
             on_in_flight: Callable[[Callable[[], list[str]]], None] = lambda f: None,
             screen: bool = False,
             wrap: Callable[[Planner], Planner] = lambda planner: planner) -> tuple[Outcome, Budget]:
    """Search the run until a stop rule fires or a signal stops it. The outcome says which
    generations the candidates were tried on (`outcome.generations`). `on_in_flight` gets a
    callable that says what the running trials are doing (for the progress line). `wrap`: the
    planner the search asks, around the one the settings name (a corpus's class planner)."""
    from agent.executors.local import LocalExecutor  # torch: past the flags' checks
    from agent.setup.jobs import check_model_unchanged
    from sandbox.runner import Limits
    problems = run.problems()
    if not problems:
        raise UserError(f"{run.path}: no frozen problems to tune (see skipped regions in run.json)")
    for p in problems:
        check_model_unchanged(p)
    executor, slots, notes, generations = _executor(run, problems, devices, executor_name, ray_address,
                                                    limits or Limits(budget_ms=150), memory_gb, workers_per_gpu)
    try:
        planner = wrap(make_planner(planner_spec, inbox=run.inbox, llm_model=llm_model, base_url=base_url,
                                    max_usd=stop_rule.max_usd, record=_recorder(run), usd_spent=lambda: _usd(run),
                                    device=", ".join(generations), notify=_stopped_planner(run, on_note),
                                    on_failure=lambda e: _stopped_planner(run, on_note)(str(e))))
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
    budget = Budget(stop_rule, spent_seconds=sum(t.gpu_seconds for t in history.trials),
                    candidates_tried=len(history.records))
    budget.remember(history.trials)
    on_budget(budget)
    on_in_flight(getattr(executor, "in_flight", lambda: []))
    stop = threading.Event()
    stopped_by: list[str] = []
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    def interrupt(signum, frame):  # the first signal: finish cleanly; a second: the command's own
        stop.set()
        stopped_by.append(STOP_SIGNALS.get(signum, f"signal {signum}"))
        budget.stop_reason = f"interrupted ({stopped_by[0]})"  # what the store's stop event says
        _restore(previous)
        if signum == signal.SIGHUP:
            detach_from_terminal()
        if hasattr(executor, "interrupt"):  # Ray: the run loop tells the actors
            executor.interrupt()
        else:
            for r in executor.runners:
                r.worker.kill()

    main = threading.current_thread() is threading.main_thread()
    if main:
        for sig, old in previous.items():
            if not (sig == signal.SIGHUP and old is signal.SIG_IGN):  # nohup: hangups stay ignored
                signal.signal(sig, interrupt)
    try:
        outcome = tune(run, problems, planner, executor, budget, history, on_trial, stop.is_set, screen=screen,
                       retime=True)
    except ValueError as e:  # ClusterError: the Ray cluster lost every worker of a target generation
        if type(e).__name__ != "ClusterError":
            raise
        raise UserError(f"{str(e).splitlines()[0]}; continue with: agent tune --resume {run.path} "
                        "--executor ray") from None
    finally:
        executor.close()
        if main and not is_stopping():  # a second signal's handling ignores any further one
            _restore(previous)
    if stop.is_set():
        outcome.stop_reason = f"interrupted ({stopped_by[0] if stopped_by else 'Ctrl-C'})"
    outcome.generations = list(executor.generations)
    return outcome, budget


def _executor(run: RunFolder, problems: list[Problem], devices: str | None, executor_name: str,
              ray_address: str | None, limits: Limits, memory_gb: float, workers_per_gpu: int | None):
    """(the Ray executor or None: the local one is built once the planner is, the local slots,
    notes for the user, the generations the candidates run on)."""
    from agent.executors.local import BUSY_NOTE, parse_devices
    check_executor(executor_name, devices, ray_address)
    if executor_name == "ray":
        executor = _ray_executor(run, problems, ray_address, limits, memory_gb, workers_per_gpu)
        return executor, [], [executor.describe()], executor.generations
    try:
        slots, notes = parse_devices(devices)
    except ValueError as e:
        raise UserError(str(e)) from None
    if devices is None and slots and all(s.device == "cpu" for s in slots) \
            and any(p.device != "cpu" for p in problems) and any(BUSY_NOTE in n for n in notes):
        # Every GPU is busy: CPU trials of GPU-frozen problems would compare against another
        # device's references at CPU speed all night. Say so now rather than waste the night.
        raise UserError("no idle GPU (" + "; ".join(n for n in notes if BUSY_NOTE in n) + ") and the "
                        "problems were frozen on a GPU. Free it, share it with --devices cuda:0, or run "
                        "CPU trials on purpose with --devices cpu")
    return None, slots, notes, sorted({s.generation for s in slots})


def _restore(handlers: dict) -> None:
    for sig, old in handlers.items():
        if old is not None:
            signal.signal(sig, old)


def _stopped_planner(run: RunFolder, on_note: Callable[[str], None]) -> Callable[[str], None]:
    """How a planner says it stopped (an API that keeps failing, unreadable answers, a bug):
    an event in the store, for the report, and a line for the user now."""
    def notify(reason: str) -> None:
        store = run.store()
        try:
            store.event("planner_stopped", reason=reason)
        finally:
            store.close()
        on_note(reason)
    return notify


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
