"""`agent`: the command line. It parses arguments, calls the library, prints, and exits.

Exit codes: 0 success; 1 the verdict was negative (a rejected candidate, a failed check);
2 bad input (a wrong flag, a broken model file, an invalid budget); 130 interrupted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.live import Live

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="nightshift: overnight, accuracy-gated search for faster GPU kernels.")
out = Console(width=None if sys.stdout.isatty() else 150)
err = Console(stderr=True)


def _fail(message: str, code: int = 2) -> None:
    from rich.markup import escape  # a path like runs/[old]/m.py is text, not markup
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)  # one line, however long
    raise typer.Exit(code)


def _emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def _guard(fn):
    """Turn the library's user-facing errors into one line and exit code 2."""
    from functools import wraps

    @wraps(fn)
    def wrapper(*args, **kwargs):
        from agent.jobs import UserError
        from tools.modelfile import ModelFileError
        from tools.problem import ProblemError
        try:
            return fn(*args, **kwargs)
        except (UserError, ModelFileError, ProblemError) as e:
            _fail(str(e))
        except ValidationError as e:
            _fail("; ".join(_validation_text(x) for x in e.errors()))
    return wrapper


def _validation_text(error: dict) -> str:
    """Our validators already name the field; pydantic's own messages do not."""
    msg = error["msg"].removeprefix("Value error, ")
    field = ".".join(map(str, error["loc"]))
    return msg if field and msg.startswith(field) else f"{field}: {msg}"


def _names(text: Optional[str]) -> Optional[list[str]]:
    return [n.strip() for n in text.split(",") if n.strip()] if text else None


def _stop_rule(gpu_hours: float, max_candidates: int, patience: int, max_usd: Optional[float] = None):
    from tools.problem import StopRule
    return StopRule(gpu_hours=gpu_hours, max_candidates=max_candidates, patience=patience, max_usd=max_usd)


@app.command()
@_guard
def doctor(json_out: bool = typer.Option(False, "--json", help="Machine-readable report."),
           refresh: bool = typer.Option(False, help="Measure the device ceilings again.")):
    """Check GPUs, versions, Triton, API keys (set or not, never shown) and measure device ceilings."""
    from agent.doctor import render_doctor, run_doctor
    report = run_doctor(refresh=refresh)
    _emit_json(report) if json_out else out.print(render_doctor(report))
    raise typer.Exit(0 if report["ok"] else 1)


@app.command()
@_guard
def profile(model: Path = typer.Option(..., "--model", help="Model file (KernelBench convention)."),
            device: str = typer.Option("auto", help="cuda, cuda:N or cpu (auto: cuda if present)."),
            workload: Optional[str] = typer.Option(None, help="Profile one named workload only."),
            runs_dir: Path = typer.Option(Path("runs"), help="Where run folders are created."),
            tolerance: Optional[str] = typer.Option(None, help="abs:VALUE or rel:VALUE for every region."),
            region_tolerance: list[str] = typer.Option([], help="CLASS=abs:VALUE, per region; repeatable."),
            e2e_tolerance: Optional[str] = typer.Option(None, help="abs:VALUE or rel:VALUE for the whole model's "
                                                        "outputs (default: by dtype and magnitude)."),
            coverage: float = typer.Option(0.9, help="Freeze the fewest regions covering this share of time."),
            max_regions: int = typer.Option(8, help="Freeze at most this many regions."),
            freeze: bool = typer.Option(True, help="Freeze problems for the selected regions."),
            regions: Optional[str] = typer.Option(None, help="Freeze these classes (comma-separated) instead."),
            top: int = typer.Option(15, help="Rows in the hotspot table."),
            torch_table: bool = typer.Option(False, help="Also print torch.profiler's own table."),
            json_out: bool = typer.Option(False, "--json", help="Machine-readable output.")):
    """Profile a model, print its hotspots, and freeze the top regions as problems."""
    from agent.jobs import profile_and_freeze
    from tools.profiler import render_hotspots, torch_profiler_table
    res = profile_and_freeze(model, device, workload, runs_dir, tolerance=tolerance,
                             region_tolerance=region_tolerance, coverage=coverage, max_regions=max_regions,
                             freeze_problems=freeze, regions=_names(regions), e2e_tolerance=e2e_tolerance)
    if json_out:
        _emit_json({"run": str(res.run.path), "hotspots": json.loads(res.result.model_dump_json()),
                    "problems": [p.name for p in res.problems], "skipped": res.skipped})
        return
    out.print(render_hotspots(res.result, top=top))
    if torch_table:
        from tools.modelfile import load_model
        out.print(torch_profiler_table(load_model(model, res.result.device), res.result.device, workload))
    for p in res.problems:
        out.print(f"froze [bold]{p.name}[/] ({p.region_path}, {p.share_of_model:.0%} of time), tolerance {p.tolerance}")
    for name, why in res.skipped.items():
        out.print(f"skipped {name}: {why}")
    out.print(f"run folder: [bold]{res.run.path}[/]  (trace.json opens in Perfetto)")


@app.command("try")
@_guard
def try_(target: Path = typer.Argument(..., help="A run folder or a problem folder."),
         candidate: Path = typer.Argument(..., help="Candidate file defining forward(module, *inputs)."),
         region: Optional[str] = typer.Option(None, help="The problem, when the run has several."),
         device: Optional[str] = typer.Option(None, help="cuda, cuda:N or cpu (default: the freeze device)."),
         json_out: bool = typer.Option(False, "--json", help="The verdict as JSON (what coding agents read).")):
    """Verify and time one candidate in the sandbox; exit 0 if it passed, 1 if rejected."""
    from agent.jobs import try_candidate
    trial = try_candidate(target, candidate, region, device)
    if json_out:
        _emit_json(trial.model_dump(mode="json"))
    else:
        colour = "green" if trial.status.value == "ok" else "red"
        from rich.markup import escape  # the reason may quote the candidate's own exception
        out.print(f"[bold {colour}]{trial.status.value}[/]: {escape(trial.reason)}")
        if trial.error is not None:
            out.print(f"error {trial.error:.3g} vs tolerance {trial.tolerance}; fresh inputs {trial.fresh_error}")
        for t in trial.timings:
            label = "CPU timing" if t.timing_kind == "cpu" else "GPU timing"
            out.print(f"  {t.workload}: baseline {t.baseline_ms:.4f} ms, candidate {t.candidate_ms:.4f} ms, "
                      f"{t.speedup:.2f}x ({label}, spread {t.candidate_spread:.1%}, {t.reps} reps)")
        if trial.speedup:
            out.print(f"weighted speedup {trial.speedup:.2f}x" + (" (CPU timing)" if trial.device == "cpu" else ""))
        for f in trial.flags:
            out.print(f"[yellow]flag:[/] {f}")
        if trial.error_text and trial.status.value != "ok":
            out.print(trial.error_text[-1500:], markup=False, highlight=False)
    raise typer.Exit(0 if trial.status.value == "ok" else 1)


@app.command()
@_guard
def tune(model: Optional[Path] = typer.Option(None, "--model", help="Model file: profile, freeze, then search."),
         resume: Optional[Path] = typer.Option(None, "--resume", help="Continue this run folder."),
         planner: str = typer.Option("template", help="template, anthropic, openai, files, or several: "
                                     "template,anthropic."),
         llm_model: Optional[str] = typer.Option(None, help="Model for LLM planners (default: "
                                                 "$NIGHTSHIFT_ANTHROPIC_MODEL / $NIGHTSHIFT_OPENAI_MODEL)."),
         base_url: Optional[str] = typer.Option(None, help="API base URL (OpenAI-compatible servers too)."),
         max_usd: Optional[float] = typer.Option(None, help="Stop LLM proposals past this many dollars."),
         devices: Optional[str] = typer.Option(None, help="cuda:0,cuda:1 | cpu | cpu@a,cpu@b (default: idle GPUs)."),
         executor: str = typer.Option("local", help="local (this machine's devices) or ray (a Ray cluster: "
                                      "one worker actor per GPU, pools per generation)."),
         ray_address: Optional[str] = typer.Option(None, help="Ray cluster to join (default with --executor ray: "
                                                   "start a local one)."),
         workers_per_gpu: int = typer.Option(0, help="Sandbox workers sharing each GPU (0: by CPU cores per GPU)."),
         device: str = typer.Option("auto", help="Device for profiling and the frozen references."),
         workload: Optional[str] = typer.Option(None, help="Use one named workload only."),
         gpu_hours: float = typer.Option(0.25, help="Cap on device time over all devices, hours."),
         max_candidates: int = typer.Option(200, help="Cap on candidates tried."),
         patience: int = typer.Option(40, help="Stop a region after N passing trials without improvement."),
         tolerance: Optional[str] = typer.Option(None, help="abs:VALUE or rel:VALUE for every region."),
         region_tolerance: list[str] = typer.Option([], help="CLASS=abs:VALUE, per region; repeatable."),
         e2e_tolerance: Optional[str] = typer.Option(None, help="abs:VALUE or rel:VALUE for the whole model's "
                                                     "outputs (default: by dtype and magnitude)."),
         max_regions: int = typer.Option(8, help="Freeze at most this many regions."),
         regions: Optional[str] = typer.Option(None, help="Freeze these classes (comma-separated)."),
         runs_dir: Path = typer.Option(Path("runs"), help="Where run folders are created."),
         integrate: bool = typer.Option(True, help="Apply the winners to the whole model, check and time it "
                                        "end to end (--no-integrate skips it)."),
         baselines: Optional[bool] = typer.Option(None, help="Time torch.compile baselines end to end "
                                                  "(default: on GPUs, not on the CPU)."),
         json_out: bool = typer.Option(False, "--json", help="Summary as JSON, no live view.")):
    """The main job: profile, freeze problems, search until the budget runs out, report."""
    from agent import jobs, report
    from agent.view import budget_line, progress_rows, progress_table
    from tools.runfolder import RunFolder
    if (model is None) == (resume is None):
        _fail("give either --model FILE (a new run) or --resume RUN (continue one)")
    rule = _stop_rule(gpu_hours, max_candidates, patience, max_usd)
    jobs.check_planner(planner, llm_model, base_url)
    jobs.check_executor(executor, devices, ray_address)
    if workers_per_gpu < 0:
        _fail(f"--workers-per-gpu must be 0 (automatic) or more, not {workers_per_gpu}")
    if resume is not None:
        run = RunFolder.open(resume)
    else:
        res = jobs.profile_and_freeze(model, device, workload, runs_dir, tolerance=tolerance, stop_rule=rule,
                                      max_regions=max_regions, regions=_names(regions),
                                      region_tolerance=region_tolerance, e2e_tolerance=e2e_tolerance)
        run = res.run
        if not json_out:
            out.print(f"run folder [bold]{run.path}[/]: froze {', '.join(p.name for p in res.problems) or 'nothing'}")
    problems = run.problems()
    on_cpu = all(d.partition("@")[0].strip() == "cpu" for d in (devices or "cpu").split(",") if d.strip())
    kind = "cpu" if all(p.device == "cpu" for p in problems) and on_cpu else "cuda"  # cpu@a,cpu@b is the CPU too
    from agent.history import History
    seen = History()

    def table(budget_obj=None):
        spent = budget_obj.spent if budget_obj else 0.0
        tried = budget_obj.tried if budget_obj else 0
        return progress_table(progress_rows(problems, seen), kind, budget_line(spent, gpu_hours, tried, max_candidates))

    from agent.loop import load_history
    for t in load_history(run, problems, []).trials:
        seen.add(t)
    holder: dict = {}
    live = None if json_out else Live(table(), console=out, refresh_per_second=2, transient=False)

    def on_trial(trial):
        seen.add(trial)
        if live is not None:
            live.update(table(holder.get("budget")))

    if live is not None:
        live.start()
    try:
        outcome, budget = jobs.run_tune(run, planner, devices, rule, on_trial=on_trial, llm_model=llm_model,
                                        base_url=base_url, executor_name=executor, ray_address=ray_address,
                                        workers_per_gpu=workers_per_gpu or None,
                                        on_note=lambda note: err.print(f"note: {note}", markup=False))
        holder["budget"] = budget
    finally:
        if live is not None:
            live.update(table(holder.get("budget")))
            live.stop()
    integration = None
    if integrate and not outcome.stop_reason.startswith("interrupted"):
        first = (devices or "").split(",")[0].partition("@")[0].strip() or None
        integration = _integrate(run, first, baselines, json_out)
    report_path = report.write(run)
    summary = {"run": str(run.path), "stop_reason": outcome.stop_reason, "trials": outcome.trials_run,
               "rounds": outcome.rounds, "best_speedup": outcome.best, "report": str(report_path),
               "gpu_seconds": budget.spent, "timing_kind": kind}
    if integrate:
        from agent.integrate import summary as integration_summary
        summary["integration"] = integration if integration is None or isinstance(integration, str) \
            else integration_summary(integration)
    if json_out:
        _emit_json(summary)
    else:
        out.print(f"\nstopped: {outcome.stop_reason}. report: [bold]{report_path}[/]")
        out.print(f"continue with: agent tune --resume {run.path}")
    if outcome.stop_reason.startswith("interrupted"):
        raise typer.Exit(130)


def _integrate(run, device: Optional[str], baselines: Optional[bool], quiet: bool):
    """Integration after a search: the result, or one line saying why there is none (a search
    that found something must not end in a traceback because the end-to-end check could not run)."""
    from agent.integrate import IntegrationError, integrate, render
    from agent.jobs import UserError
    from tools.problem import ProblemError
    on_gpu = (device or "").startswith("cuda") or (not device and _cuda_run(run))
    want = on_gpu if baselines is None else baselines
    try:
        result = integrate(run, device, baselines=want)  # its notes are part of the rendered result
    except (IntegrationError, UserError, ProblemError) as e:
        if not quiet:
            err.print(f"integration: {e}", markup=False)
        return f"not integrated: {e}"
    if not quiet:
        out.print()
        out.print(render(result))
    return result


def _cuda_run(run) -> bool:
    try:
        from tools.capture import MODEL_DIR
        from tools.problem import Problem
        import torch
        return Problem.load(run.path / MODEL_DIR).device == "cuda" and torch.cuda.is_available()
    except Exception:
        return False


@app.command("integrate")
@_guard
def integrate_(run: Path = typer.Argument(..., help="Run folder."),
               device: Optional[str] = typer.Option(None, help="cuda, cuda:N or cpu (default: the freeze device)."),
               baselines: Optional[bool] = typer.Option(None, help="Time torch.compile baselines (default: on "
                                                        "GPUs, not on the CPU, where they are slow to compile)."),
               json_out: bool = typer.Option(False, "--json", help="integration.json on stdout.")):
    """Apply the winners to the whole model, check it against the frozen model outputs, time it."""
    from agent.integrate import IntegrationError, integrate, render
    from tools.runfolder import RunFolder
    folder = RunFolder.open(run)
    want = baselines if baselines is not None else (
        (device or "").startswith("cuda") or (not device and _cuda_run(folder)))
    try:
        result = integrate(folder, device, baselines=want)
    except IntegrationError as e:
        _fail(str(e), 1)
    if json_out:
        _emit_json(json.loads(result.model_dump_json()))
    else:
        out.print(render(result))
        out.print(f"wrote {folder.path / 'integration.json'}", markup=False, highlight=False)


@app.command()
@_guard
def status(run: Path = typer.Argument(..., help="Run folder (may be running elsewhere)."),
           json_out: bool = typer.Option(False, "--json", help="Machine-readable output.")):
    """Progress of a run: per region trials, passing, best speedup, error vs tolerance, budget."""
    from agent.loop import load_history
    from agent.view import budget_line, progress_rows, progress_table
    from tools.runfolder import RunFolder
    folder = RunFolder.open(run)
    problems = folder.problems()
    history = load_history(folder, problems, [])
    rule = folder.info().options.get("stop_rule", {})
    spent = sum(t.gpu_seconds for t in history.trials)
    rows = progress_rows(problems, history)
    if json_out:
        _emit_json({"run": str(folder.path), "regions": rows, "gpu_seconds": spent, "stop_rule": rule})
        return
    kind = "cpu" if all(p.device == "cpu" for p in problems) else "cuda"
    out.print(progress_table(rows, kind, budget_line(spent, rule.get("gpu_hours", 0.0), len(history.records),
                                                      rule.get("max_candidates", 0))))


@app.command("report")
@_guard
def report_(run: Path = typer.Argument(..., help="Run folder.")):
    """Write runs/<run>/report.md and a self-contained report.html from what the store holds now (also mid-run)."""
    from agent import report
    from tools.runfolder import RunFolder
    md = report.write(RunFolder.open(run))
    out.print(f"wrote {md}\nand {md.with_name('report.html')}", markup=False, highlight=False)


@app.command("apply")
@_guard
def apply_(run: Path = typer.Argument(..., help="Run folder."),
           region: list[str] = typer.Option([], "--region", help="Only this region (repeatable, or A,B)."),
           dry_run: bool = typer.Option(False, "--dry-run", help="Print the patch and what would be written; "
                                        "write nothing."),
           json_out: bool = typer.Option(False, "--json", help="Machine-readable output.")):
    """Write the winners as <model>_nightshift.py next to the model and a patch routing the model through
    it (runs/<run>/patches/<model>.patch); exit 1 if no region has a winner to apply."""
    from agent.apply import apply_run
    res = apply_run(run, [n for r in region for n in _names(r) or []] or None, dry_run=dry_run)
    if json_out:
        _emit_json(res.to_json())
        raise typer.Exit(0 if res.regions else 1)
    plain = {"markup": False, "highlight": False, "soft_wrap": True}
    source = "kept end to end (integration.json)" if res.chosen_by == "integration" else \
        "best kept candidate per region (no integration.json)"
    out.print(f"run {res.run_id}: {len(res.regions)} region(s) to apply, {source}", **plain)
    for r in res.regions:
        speed = f"{r['speedup']:.2f}x" if r["speedup"] else "n/a"
        error = f"{r['error']:.3g}" if r["error"] is not None else "n/a"
        out.print(f"  {r['region']}: candidate {r['candidate_hash']}, {speed}, error {error} vs {r['tolerance']}",
                  **plain)
    for name, why in res.skipped.items():
        out.print(f"  {name}: not applied ({why})", **plain)
    for w in res.warnings:
        err.print(f"warning: {w}", **plain)
    if not res.regions:
        out.print("nothing to apply", **plain)
        raise typer.Exit(1)
    if res.dry_run:
        if res.patch:
            sys.stdout.write(res.patch)
        else:
            out.print(f"{res.model_file} already routes through {Path(res.kernels_module).name} "
                      "(already applied): the patch is empty", **plain)
        for p in res.would_write:
            out.print(f"would write {p}", **plain)
        return
    for p in res.written:
        out.print(f"wrote {p}", **plain)
    if res.already_applied:
        out.print(f"{res.model_file} already routes through {Path(res.kernels_module).name} (already applied): "
                  "nothing to patch", **plain)
    else:
        out.print(f"apply it: {res.apply_command}", **plain)


skill_app = typer.Typer(no_args_is_help=True, help="The coding-agent skill (Claude Code, Codex).")
app.add_typer(skill_app, name="skill")


@skill_app.command("install")
def skill_install(claude: bool = typer.Option(False, "--claude", help="Claude Code: .claude/skills/nightshift/SKILL.md."),
                  codex: bool = typer.Option(False, "--codex", help="Codex: a nightshift section in AGENTS.md."),
                  user: bool = typer.Option(False, "--user", help="Into your home (~/.claude, ~/.codex) instead."),
                  project: Path = typer.Option(Path("."), "--project", help="Project folder (default: here)."),
                  json_out: bool = typer.Option(False, "--json", help="The files written, as JSON.")):
    """Install the skill for Claude Code and/or Codex (default: both) into a project or your home."""
    from agent.skill import SkillError, install
    targets = [t for t, chosen in (("claude", claude), ("codex", codex)) if chosen] or ["claude", "codex"]
    try:
        written = [p for t in targets for p in install(t, project, Path.home(), user=user)]
    except (SkillError, OSError) as e:
        _fail(str(e))
    if json_out:
        _emit_json({"written": [str(p) for p in written]})
    else:
        for p in written:
            out.print(f"wrote {p}", markup=False, highlight=False)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
