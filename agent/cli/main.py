"""`agent`: the command line. It parses arguments, calls the library, prints, and exits.

Exit codes: 0 success; 1 the verdict was negative (a rejected candidate, a failed check, a
search in which no planner could propose anything); 2 bad input (a wrong flag, a broken model
file, an invalid budget, a damaged run folder: one `error:` line, never a traceback or a usage
box); 130 interrupted (Ctrl-C, SIGTERM or SIGHUP: a clean stop, the report written).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from agent.cli.lines import PLAIN, err, fail as _fail, guard as _guard, out, say as _say
from agent.flags import BASELINES, model_files, model_weights, parse_compile_modes
from agent.json_stdout import claim as _stdout_for_json, emit as _emit_json
from tools.corpus import CorpusFolder, is_corpus

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="nightshift: overnight, accuracy-gated search for faster GPU kernels.")


TRACE_HELP = ("A request trace (JSON Lines: arrival_s, prompt_tokens, output_tokens, shared_prefix_tokens): "
              "its requests grouped into named shapes, weighted by what each costs the trace, replace the "
              "model's own workloads (needs make_workload() in the model file; see tools/traffic.py).")


COMPILE_MODES_HELP = (f"The torch.compile modes to compare against ({', '.join(BASELINES)}; comma-separated, "
                      "default all). max-autotune-no-cudagraphs alone compiles for minutes on a large model.")
NO_JAIL_HELP = ("Run candidates without the sandbox's jail, with your user's rights (they can read your keys and "
                "files): needed for code nightshift did not write (LLM or files planners, agent try) where no jail "
                "can run; agent doctor says why none can.")


def _no_jail(given: bool) -> None:
    if given:
        from sandbox.jail import turn_off
        turn_off()


def _names(text: Optional[str]) -> Optional[list[str]]:
    return [n.strip() for n in text.split(",") if n.strip()] if text else None


@app.command()
@_guard
def doctor(json_out: bool = typer.Option(False, "--json", help="Machine-readable report."),
           refresh: bool = typer.Option(False, help="Measure the device ceilings again.")):
    """Check GPUs, versions, Triton, API keys (set or not, never shown) and measure device ceilings."""
    from agent.setup.doctor import render_doctor, run_doctor
    report = run_doctor(refresh=refresh)
    _emit_json(report) if json_out else out.print(render_doctor(report))
    raise typer.Exit(0 if report["ok"] else 1)


@app.command()
@_guard
def profile(models: list[Path] = typer.Option(..., "--model", help="Model file (KernelBench convention)."),
            device: str = typer.Option("auto", help="cuda, cuda:N or cpu (auto: cuda if present)."),
            workload: Optional[str] = typer.Option(None, help="Profile one named workload only."),
            workloads: Optional[Path] = typer.Option(None, "--workloads", help=TRACE_HELP),
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
    if len(models) > 1:  # never a model silently dropped
        _fail(f"agent profile takes one --model (given {len(models)}); agent tune --model A --model B tunes several")
    model = models[0]
    _stdout_for_json(json_out)
    from agent.flags import check_freeze_flags
    check_freeze_flags(model, runs_dir, tolerance=tolerance, e2e_tolerance=e2e_tolerance,
                       region_tolerance=region_tolerance, max_regions=max_regions, coverage=coverage,
                       freeze_problems=freeze)
    from agent.setup.jobs import native_stderr_without, profile_and_freeze
    from tools.profiler import render_hotspots, torch_profiler_table
    res = profile_and_freeze(model, device, workload, runs_dir, tolerance=tolerance,
                             region_tolerance=region_tolerance, coverage=coverage, max_regions=max_regions,
                             freeze_problems=freeze, regions=_names(regions), e2e_tolerance=e2e_tolerance,
                             trace=workloads)
    if json_out:
        _emit_json({"run": str(res.run.path), "hotspots": res.result,
                    "problems": [p.name for p in res.problems], "skipped": res.skipped})
        return
    out.print(render_hotspots(res.result, top=max(0, top)))
    if torch_table:
        from tools.modelfile import load_model
        with native_stderr_without("USDT:"):  # torch's profiler chatter on file descriptor 2
            table = torch_profiler_table(load_model(model, res.result.device), res.result.device, workload)
        out.print(table)
    for line in res.lines():
        _say(line)


@app.command("try")
@_guard
def try_(target: Path = typer.Argument(..., help="A run folder or a problem folder."),
         candidate: Path = typer.Argument(..., help="Candidate file defining forward(module, *inputs)."),
         region: Optional[str] = typer.Option(None, help="The problem, when the run has several."),
         device: Optional[str] = typer.Option(None, help="cuda, cuda:N or cpu (default: the freeze device)."),
         json_out: bool = typer.Option(False, "--json", help="The verdict as JSON (what coding agents read)."),
         no_jail: bool = typer.Option(False, "--no-jail", help=NO_JAIL_HELP)):
    """Verify and time one candidate in the sandbox; exit 0 if it passed, 1 if rejected."""
    _no_jail(no_jail)
    from tools.runfolder import RunFolder
    if (target / "run.json").is_file():  # a damaged run is named before torch's import, as by try_candidate
        RunFolder.open(target).check_store()
    from agent.setup.jobs import try_candidate
    from agent.cli.view import trial_lines
    trial = try_candidate(target, candidate, region, device)
    if json_out:
        _emit_json(trial.model_dump(mode="json"))
    else:
        for line in trial_lines(trial):
            _say(line)
    raise typer.Exit(0 if trial.status.value == "ok" else 1)


@app.command()
@_guard
def tune(model: list[Path] = typer.Option([], "--model", help="Model file: profile, freeze, then search. Repeat "
                                          "it for a corpus: each distinct problem searched once, winners shared."),
         models: Optional[Path] = typer.Option(None, "--models", help="A folder of model files (*.py): one corpus."),
         model_weight: list[str] = typer.Option([], help="NAME=W: how much a corpus model's time counts in the "
                                                "budget's split (default 1); repeatable."),
         resume: Optional[Path] = typer.Option(None, "--resume", help="Continue this run folder, with the "
                                               "settings it was started with (flags given override them)."),
         planner: Optional[str] = typer.Option(None, help="auto (default: templates, then torch.compile's candidates "
                                               "for a region the templates have nothing new for), template, compiler "
                                               "(torch.compile modes and options), anthropic, openai, files, or "
                                               "several: template,anthropic."),
         llm_model: Optional[str] = typer.Option(None, help="Model for LLM planners (default: "
                                                 "$NIGHTSHIFT_ANTHROPIC_MODEL / $NIGHTSHIFT_OPENAI_MODEL)."),
         base_url: Optional[str] = typer.Option(None, help="API base URL (OpenAI-compatible servers too)."),
         max_usd: Optional[float] = typer.Option(None, help="Stop LLM proposals past this many dollars."),
         devices: Optional[str] = typer.Option(None, help="cuda:0,cuda:1 | cpu | cpu@a,cpu@b (default: idle GPUs)."),
         executor: Optional[str] = typer.Option(None, help="local (default: this machine's devices) or ray (a "
                                                "Ray cluster: one worker actor per GPU, pools per generation)."),
         ray_address: Optional[str] = typer.Option(None, help="Ray cluster to join (default with --executor ray: "
                                                   "start a local one)."),
         workers_per_gpu: Optional[int] = typer.Option(None, help="Sandbox workers sharing each GPU (default 0: "
                                                       "by CPU cores per GPU)."),
         device: str = typer.Option("auto", help="Device for profiling and the frozen references."),
         workload: Optional[str] = typer.Option(None, help="Use one named workload only."),
         workloads: Optional[Path] = typer.Option(None, "--workloads", help=TRACE_HELP),
         model_workloads: bool = typer.Option(False, help="With --workloads: also time the model's own "
                                              "workloads (weight 0: shown, not part of the trace's cost)."),
         gpu_hours: Optional[float] = typer.Option(None, help="Cap on device time over all devices, hours "
                                                   "(default 0.25)."),
         max_candidates: Optional[int] = typer.Option(None, help="Cap on candidates tried (default 200)."),
         patience: Optional[int] = typer.Option(None, help="Stop a region after N passing trials without "
                                                "improvement (default 40)."),
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
         compile_modes: Optional[str] = typer.Option(None, help=COMPILE_MODES_HELP),
         screen: Optional[bool] = typer.Option(None, "--screen/--no-screen", help="Time in full only what a short "
                                               "screen finds not clearly slower than the best (default on GPUs)."),
         json_out: bool = typer.Option(False, "--json", help="Summary as JSON, no live view."),
         no_jail: bool = typer.Option(False, "--no-jail", help=NO_JAIL_HELP)):
    """The main job: profile, freeze problems, search until the budget runs out, report. Progress
    goes to runs/<run>/log.txt, and to stdout: a live table on a terminal, one line per trial
    otherwise."""
    _no_jail(no_jail)
    modes = parse_compile_modes(compile_modes)
    if resume is not None and not model:  # its integration runs the winners of every earlier session's planners
        from agent.setup.jobs import check_run_jail
        for run in CorpusFolder.open(resume).runs().values() if is_corpus(resume) else [resume]:
            check_run_jail(getattr(run, "path", run))
    from agent.cli.session import TuneRequest
    given = {"planner": planner, "llm_model": llm_model, "base_url": base_url, "devices": devices,
             "executor": executor, "ray_address": ray_address, "workers_per_gpu": workers_per_gpu,
             "gpu_hours": gpu_hours, "max_candidates": max_candidates, "patience": patience, "max_usd": max_usd,
             "no_jail": no_jail or None, "screen": screen}
    files = model_files(model, models)
    request = TuneRequest(files[0] if len(files) == 1 else None, resume, given, device, workload, tolerance,
                          region_tolerance, e2e_tolerance, max_regions, _names(regions), runs_dir, integrate, baselines,
                          workloads, model_workloads, modes)
    if len(files) > 1 or models is not None or (resume is not None and is_corpus(resume) and not files):
        _tune_corpus(request, files, model_weight, json_out)
    _tune_one(request, json_out)


def _tune_one(request, json_out: bool) -> None:
    """`agent tune` of one model (agent/cli/session.py): its search, integration and report."""
    from agent.cli.session import tune_session
    _stdout_for_json(json_out)
    tty = sys.stdout.isatty()
    result = tune_session(request, say=(lambda text: None) if json_out else _say,
                          warn=lambda text: err.print(f"note: {text}", **PLAIN),
                          lines=None if json_out or tty else sys.stdout, console=out if tty and not json_out else None)
    if result.outcome.planner_failure:
        err.print(f"error: {result.outcome.planner_failure}", **PLAIN)
    if json_out:
        _emit_json(result.summary())
    else:
        if result.integration is not None and not isinstance(result.integration, str):
            from agent.report.integration_view import render
            out.print()
            out.print(render(result.integration))
        _say(f"\nstopped: {result.outcome.stop_reason}. report: {result.report}")
        _say(f"log: {result.run.log_path}")
        _say(f"continue with: agent tune --resume {result.run.path}")
    raise typer.Exit(result.exit_code)


def _tune_corpus(request, files: list[Path], weights: list[str], json_out: bool) -> None:
    """`agent tune` of a corpus (agent/cli/corpus.py): its models, its classes, its report."""
    from agent.cli.corpus import CorpusRequest, corpus_session
    _stdout_for_json(json_out)
    tty = sys.stdout.isatty()
    result = corpus_session(CorpusRequest(request, files, model_weights(weights), request.resume),
                            say=(lambda text: None) if json_out else _say,
                            warn=lambda text: err.print(f"note: {text}", **PLAIN),
                            lines=None if json_out or tty else sys.stdout, console=out if tty and not json_out else None)
    if json_out:
        _emit_json(result.summary())
    else:
        _say(f"\ncorpus report: {result.report}\ncontinue with: agent tune --resume {result.folder.path}")
    if result.error:
        err.print(f"error: {result.error}", **PLAIN)
    raise typer.Exit(result.exit_code)


@app.command("integrate")
@_guard
def integrate_(run: Path = typer.Argument(..., help="Run folder."),
               device: Optional[str] = typer.Option(None, help="cuda, cuda:N or cpu (default: the freeze device)."),
               baselines: Optional[bool] = typer.Option(None, help="Time torch.compile baselines (default: on "
                                                        "GPUs, not on the CPU, where they are slow to compile)."),
               compile_modes: Optional[str] = typer.Option(None, help=COMPILE_MODES_HELP),
               json_out: bool = typer.Option(False, "--json", help="integration.json on stdout."),
               no_jail: bool = typer.Option(False, "--no-jail", help=NO_JAIL_HELP)):
    """Apply the winners to the whole model, check it against the frozen model outputs, time it."""
    _no_jail(no_jail)
    modes = parse_compile_modes(compile_modes)
    from agent.cli.session import cuda_run
    from tools.runfolder import RunFolder
    folder = RunFolder.open(run)
    folder.check_store()
    from agent.setup.jobs import check_run_jail
    check_run_jail(run)
    from agent.review.integrate import IntegrationError, integrate
    from agent.report.integration_view import render
    want = baselines if baselines is not None else (
        (device or "").startswith("cuda") or (not device and cuda_run(folder)))
    try:
        result = integrate(folder, device, baselines=want, modes=modes)
    except IntegrationError as e:
        _fail(str(e), 1)
    if json_out:
        _emit_json(result)
    else:
        out.print(render(result))
        _say(f"wrote {folder.path / 'integration.json'}")


@app.command()
@_guard
def status(run: Path = typer.Argument(..., help="Run folder (may be running elsewhere)."),
           json_out: bool = typer.Option(False, "--json", help="Machine-readable output.")):
    """Progress of a run: whether it is running or stopped (and why), per region trials, passing,
    best speedup, error vs tolerance, budget."""
    from agent.cli.view import progress_table, status_of
    from tools.runfolder import RunFolder
    if is_corpus(run):
        from agent.cli.corpus import corpus_status
        data, lines = corpus_status(run)
        _emit_json(data) if json_out else [_say(line) for line in lines]
        return
    folder = RunFolder.open(run)
    data, budget = status_of(folder)
    if json_out:
        _emit_json(data)
        return
    out.print(progress_table(data["regions"], data["timing_kind"], budget))
    _say(f"{folder.path}: {data['text']}")


@app.command("report")
@_guard
def report_(run: Path = typer.Argument(..., help="Run folder.")):
    """Write runs/<run>/report.md and a self-contained report.html from what the store holds now (also mid-run)."""
    from agent import report
    from agent.report.corpus_view import write_corpus_report
    from tools.corpus import CorpusFolder
    from tools.runfolder import RunFolder
    md = write_corpus_report(CorpusFolder.open(run)) if is_corpus(run) else report.write(RunFolder.open(run))
    _say(f"wrote {md}\nand {md.with_name('report.html')}")


@app.command("apply")
@_guard
def apply_(run: Path = typer.Argument(..., help="Run folder."),
           region: list[str] = typer.Option([], "--region", help="Only this region (repeatable, or A,B)."),
           dry_run: bool = typer.Option(False, "--dry-run", help="Print the kernels module's code and the patch "
                                        "it would write; write nothing."),
           allow_slower: bool = typer.Option(False, "--allow-slower", help="Also apply winners that are not faster "
                                             "than the original (a warning each; on the CPU none is faster)."),
           json_out: bool = typer.Option(False, "--json", help="Machine-readable output.")):
    """Write the winners as <model>_nightshift.py next to the model and a patch routing the model through
    it (runs/<run>/patches/<model>.patch). Exit 0 with something to apply; 1 with nothing to apply (a
    verdict, not an error: no candidate faster beyond its noise band, the expected result on a CPU)."""
    from agent.apply import apply_run
    res = apply_run(run, [n for r in region for n in _names(r) or []] or None, dry_run=dry_run,
                    allow_slower=allow_slower)
    if json_out:
        _emit_json(res.to_json())
    else:
        lines, warnings = res.lines()
        for w in warnings:
            err.print(w, **PLAIN)
        for line in lines:
            _say(line)
    raise typer.Exit(0 if res.regions else 1)


skill_app = typer.Typer(no_args_is_help=True, help="The coding-agent skill (Claude Code, Codex).")
app.add_typer(skill_app, name="skill")


@skill_app.command("install")
@_guard
def skill_install(claude: bool = typer.Option(False, "--claude", help="Claude Code: .claude/skills/nightshift/SKILL.md."),
                  codex: bool = typer.Option(False, "--codex", help="Codex: a nightshift section in AGENTS.md."),
                  user: bool = typer.Option(False, "--user", help="Into your home (~/.claude, ~/.codex) instead."),
                  project: Path = typer.Option(Path("."), "--project", help="Project folder (default: here)."),
                  json_out: bool = typer.Option(False, "--json", help="The files written, as JSON.")):
    """Install the skill for Claude Code and/or Codex (default: both) into a project or your home."""
    from agent.setup.skill import SkillError, install
    targets = [t for t, chosen in (("claude", claude), ("codex", codex)) if chosen] or ["claude", "codex"]
    try:
        written = [p for t in targets for p in install(t, project, Path.home(), user=user)]
    except (SkillError, OSError) as e:
        _fail(str(e))
    if json_out:
        _emit_json({"written": [str(p) for p in written]})
    else:
        for p in written:
            _say(f"wrote {p}")


def main(argv: list[str] | None = None) -> None:
    """The `agent` command: a parse error is one `error:` line and exit 2, like any bad input."""
    from agent.search.signals import signals_as_interrupts
    try:
        with signals_as_interrupts():  # SIGTERM and SIGHUP stop any command as Ctrl-C does
            code = app(args=argv, standalone_mode=False)
    except typer.Abort:
        code = 130
    except typer.TyperException as e:  # click's ClickException: a usage or parameter error
        if type(e).__name__ == "NoArgsIsHelpError":  # the help has been printed; nothing was asked
            code = 2
        else:
            ctx = getattr(e, "ctx", None)
            where = f" (see {ctx.command_path} --help)" if ctx is not None else ""
            message = e.format_message() if hasattr(e, "format_message") else str(e)
            err.print(f"error: {' '.join(message.split())}{where}", **PLAIN)
            code = getattr(e, "exit_code", 2)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
