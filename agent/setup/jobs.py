"""The jobs behind `agent profile` and `agent try`: profile and freeze a model, try one candidate.

Each returns values (or raises `UserError` with a one-line message); the CLI only parses
arguments, prints and sets the exit code.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from agent.errors import UserError
from agent.flags import check_freeze_flags
from sandbox.jail import refusal
from sandbox.pool import DevicePool
from tools.capture import RegionChoice, freeze
from tools.capture_model import MODEL_DIR, WHOLE_MODEL, freeze_model
from tools.devices import get_ceilings, software_versions
from tools.modelfile import file_sha256, load_model
from tools.problem import Problem, StopRule
from tools.profiler import ProfileResult, profile_model, select_regions
from tools.runfolder import RunFolder, RunInfo
from tools.selection import not_frozen
from tools.trial import Candidate, Trial


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

    def lines(self) -> list[str]:
        """What `agent profile` says after its table: each problem, each class not frozen and why."""
        out = []
        for p in self.problems:
            where = p.region_path or "the model itself"
            if len(p.instances) > 1:
                where += f" and {len(p.instances) - 1} more instance{'s' * (len(p.instances) > 2)}"
            out.append(f"froze {p.name} ({where}, {p.share_of_model:.0%} of time), tolerance {p.tolerance}")
        out += [f"skipped {name}: {why}" for name, why in self.skipped.items()]
        return out + [f"run folder: {self.run.path}  (trace.json opens in Perfetto)"]


def profile_and_freeze(model: Path, device: str | None, workload: str | None, runs_dir: Path, *,
                       tolerance: str | None = None, region_tolerance: list[str] = (),
                       stop_rule: StopRule | None = None, targets: list[str] | None = None,
                       coverage: float = 0.9, max_regions: int = 8, freeze_problems: bool = True,
                       regions: list[str] | None = None, e2e_tolerance: str | None = None,
                       trace: Path | None = None, trace_keep_own: bool = False,
                       on_run: Callable[[RunFolder, str], None] = lambda run, model_file: None) -> ProfileOutcome:
    """Profile the model and freeze its hotspots into a new run folder. Every input is checked
    before the model is touched; a failure after the folder was made removes it again, so a
    bad input (or Ctrl-C) leaves no half-made run behind."""
    flags = check_freeze_flags(model, runs_dir, tolerance=tolerance, e2e_tolerance=e2e_tolerance,
                               region_tolerance=region_tolerance, max_regions=max_regions, coverage=coverage,
                               freeze_problems=freeze_problems)
    tol, e2e_tol, per_region = flags.tolerance, flags.e2e_tolerance, flags.per_region
    dev = resolve_device(device)
    with user_code(model):
        loaded = load_model(model, dev, workload=workload, trace=trace, trace_keep_own=trace_keep_own)
    classes = {n for m in loaded.model.modules() for n in (type(m).__name__, type(m).__qualname__)}
    for flag, names in (("--regions", regions or []), ("--region-tolerance", list(per_region))):
        unknown = [n for n in names if n not in classes]
        if unknown:  # said before the profile, not after it
            raise UserError(f"{flag}: no module class {', '.join(unknown)} in the model "
                            f"(has: {', '.join(sorted({type(m).__name__ for m in loaded.model.modules()}))})")
    ceilings = get_ceilings(dev)
    # torch imports its compiler lazily, on the first call some ops make under the profiler's
    # modes (indexing a tensor, as a KV cache per layer does): a SIGTERM in the middle of that
    # import landed in code it execs, and the process died of SIGINT instead of exiting 130 (the
    # flag CPython sets then is cleared at exit now: agent/__main__.py).
    import torch._dynamo  # noqa: F401
    run = RunFolder.create(runs_dir, loaded.path)
    try:
        on_run(run, str(loaded.path))  # the search's workers may start now, beside the profile
        with user_code(model), native_stderr_without("USDT:"):
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
            known = {r.class_name for r in result.by_class}
            stray = [name for name in per_region if name not in known]
            if stray:
                raise UserError(f"--region-tolerance: no module class {', '.join(stray)} in the model "
                                f"(has: {', '.join(sorted(known))})")
            choices = [RegionChoice(r.class_name, r.share, tuple(k.name for k in r.top_kernels),
                                    _per_workload_ms(result, r.qualname)) for r in rows]
            skips, tried = [], set()
            # A chosen region that cannot be frozen (it keeps state between calls, say) hides its
            # parts, which selection passed over as overlapping it: choose again without it, and
            # freeze what is new, until nothing new comes (never past the user's --regions).
            while choices:
                tried |= {c.class_name for c in choices}
                with user_code(model):
                    got, missed = freeze(loaded, choices, run.problems_dir, dev, tolerance=tol,
                                         per_region=per_region, stop_rule=stop_rule, targets=targets,
                                         device_name=result.device_name, ceilings=ceilings.model_dump())
                problems, skips = problems + got, skips + missed
                if regions or not missed:
                    break
                rows = select_regions(result, coverage=coverage, max_regions=max_regions,
                                      exclude=tuple(s.class_name for s in skips))
                choices = [RegionChoice(r.class_name, r.share, tuple(k.name for k in r.top_kernels),
                                        _per_workload_ms(result, r.qualname)) for r in rows
                           if r.class_name not in tried]
            # Why each class of the model's own code (each class, when nothing was frozen) is no problem.
            classes = {type(m).__name__: f"{type(m).__module__}.{type(m).__qualname__}"
                       for m in loaded.model.modules()}
            skipped = not_frozen(result, {p.region_class for p in problems}, {s.class_name: s.reason for s in skips},
                                 classes, coverage=coverage, max_regions=max_regions, asked=regions,
                                 exclude=tuple(s.class_name for s in skips))
            try:  # the whole model's end-to-end reference, for integration
                with user_code(model):
                    freeze_model(loaded, run.path / MODEL_DIR, dev, e2e_tol, result.device_name, ceilings=ceilings.model_dump())
            except ValueError as e:
                skipped[WHOLE_MODEL] = f"no end-to-end reference: {e}"
        run.write_info(RunInfo(run_id=run.run_id, model_file=str(loaded.path), model_hash=loaded.file_hash,
                               device=dev.type, versions={k: str(v) for k, v in software_versions().items()},
                               options={"workload": workload, "trace": str(trace) if trace else None,
                                        "stop_rule": (stop_rule or StopRule()).model_dump()},
                               skipped=skipped))
    except BaseException:
        shutil.rmtree(run.path, ignore_errors=True)
        raise
    return ProfileOutcome(run, result, problems, skipped)


@contextmanager
def user_code(model: Path):
    """The user's model code runs in this process while profiling and freezing: a `sys.exit`
    in it is a bad model file, said so, not a silent exit of the tuner."""
    try:
        yield
    except SystemExit as e:
        raise UserError(f"{model}: the model file called sys.exit({e.code!r}) while it was loaded or run; "
                        "a model file must not exit") from None


@contextmanager
def native_stderr_without(*prefixes: str):
    """Drop lines starting with `prefixes` that native code (torch's profiler prints `USDT:`
    lines from C++) writes to file descriptor 2 meanwhile; everything else reaches stderr."""
    import sys
    import tempfile
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real stderr to filter
        yield
        return
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = [ln for ln in capture.read().splitlines(keepends=True) if not ln.startswith(
                tuple(p.encode() for p in prefixes))]
            if kept:
                with suppress(OSError):  # a terminal that hung up meanwhile
                    os.write(2, b"".join(kept))


def _per_workload_ms(result: ProfileResult, qualname: str) -> dict[str, float]:
    out = {}
    for w in result.workloads:
        row = next((c for c in w.by_class if c.qualname == qualname), None)
        if row is not None and row.calls:
            out[w.name] = row.inclusive_ms / row.calls
    return out


def find_problem(target: Path, region: str | None) -> Path:
    """A problem folder from a problem path, or a run folder plus --region (or its only problem)."""
    target = Path(target)
    if (target / "problem.json").is_file():
        return target
    if not (target / "run.json").is_file():
        raise UserError(f"{target}: neither a run folder nor a problem folder")
    names = [p.name for p in RunFolder.open(target).problems()]
    if region:
        if region not in names:
            raise UserError(f"{target}: no problem {region!r} (has: {', '.join(names) or 'none'})")
        return target / "problems" / region
    if len(names) != 1:
        raise UserError(f"{target} has problems {', '.join(names) or '(none)'}: choose one with --region")
    return target / "problems" / names[0]


def check_run_jail(run_path: Path) -> None:
    """Integration runs a run's winners again: code from an LLM or a user's files runs only
    jailed, or under --no-jail (a UserError says which planners and why)."""
    folder = RunFolder.open(run_path)
    if not folder.check_store():
        return
    store = folder.store(readonly=True)
    try:
        planners = sorted({t.planner for t in store.trials() if t.status.value == "ok"})
    finally:
        store.close()
    if why := refusal(planners, f"integrating {run_path}"):
        raise UserError(why)


def try_candidate(target: Path, candidate: Path, region: str | None, device: str | None,
                  record: bool = True) -> Trial:
    folder = find_problem(target, region)
    if not candidate.is_file():
        raise UserError(f"{candidate}: candidate file not found")
    if why := refusal(["manual"], f"agent try {candidate}"):
        raise UserError(why)
    problem = Problem.load(folder)
    check_model_unchanged(problem)
    dev = resolve_device(device or problem.device)
    run = RunFolder.open(folder.parent.parent) if (folder.parent.parent / "run.json").is_file() else None
    if run is not None and record:
        run.check_store()  # a damaged store is said before the trial, not after it ran
    try:
        source = candidate.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{candidate}: cannot read the candidate ({e})") from None
    pool = DevicePool(str(dev) if dev.type == "cpu" else f"cuda:{dev.index or 0}", [folder])
    try:
        c = Candidate(region=problem.name, source=source, planner="manual", note=candidate.name)
        path = str(run.save_candidate(c.source, c.hash)) if run and record else str(candidate)
        trial = pool.run(c, candidate_path=path)
    finally:
        pool.close()
    if run is not None and record:
        store = run.store()
        store.record(trial)
        store.close()
    return trial


def check_model_unchanged(problem: Problem) -> None:
    path = Path(problem.model_file)
    if not path.is_file():
        raise UserError(f"{path}: the model file of this problem is gone")
    if file_sha256(path) != problem.model_hash:
        raise UserError(f"{path} changed since problem {problem.name} was frozen (hash mismatch): "
                        "profile again to freeze new problems")
