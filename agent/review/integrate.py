"""Integration: the search's winners applied to the whole model, checked and timed end to end.

The whole model is one more problem (`runs/<run>/model/`, region path "", a tolerance per
workload), and everything here is a candidate for it, run through the same sealed trial path
as any region (sandbox/runner.py): load, verify, time.

    each region's best winner (a per-shape dispatcher first, where one is at least as fast on
    every workload), all routed in at once: every way of running the model compiled side by
    side (tuned, its CUDA graph, each torch.compile mode alone and with our kernels inside),
    then each verified and timed against the untouched model (A/A noise band included)
    the tuned model failed end to end?  (errors that compound)
        regions by expected gain (share of model x (1 - 1/speedup)), their winners best first
        (at most 3): routed in after the ones accepted so far, verified; the first that passes
        is accepted, the rest dropped with the reason; then every way again with those
    the tuned model slower on some workloads beyond the band (on a GPU)?
        every way with our kernels again, each winner leaving those workloads' shapes to the
        original's code (the regions were judged by device time; a host-bound model pays the
        routing's Python); each compiled way runs, per region, its winner only where it beat
        torch.compile of the region
    the compile modes of the untouched model come from the search's early baselines where a
    tune started them (agent/review/early_baselines.py)

The result is `runs/<run>/integration.json` (tools/e2e.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from agent.review import dispatch
from agent.history import CandidateRecord, History
from agent.history import load_history
from agent.review.compile_caches import CompileCaches
from agent.review.plans import MAX_TRIES, candidate_path, model_floors, plans, sourced
from agent.review.ways import (BASELINES, LIMITS, NoWholeModel, baseline_ways, composed_name, phases, routed_candidate, side_by_side, ways_of,
                        whole_model)
from sandbox.pool import DevicePool
from sandbox.runner import Limits, TrialRunner, seed
from tools.e2e import AcceptedRegion, DroppedCandidate, IntegrationResult, WorkloadResult, record_failure
from tools.problem import Problem
from tools.runfolder import RunFolder
from tools.trial import Candidate, Trial

GRAPHED_WAY = "nightshift + CUDA graphs"
"""The tuned model captured in a CUDA graph per workload shape, where that is not the one timed."""
UNGRAPHED_WAY = "nightshift, no CUDA graphs"
"""The tuned model as routed, where its CUDA-graph capture was faster overall and is the one timed."""

if TYPE_CHECKING:
    from agent.review.early_baselines import EarlyBaselines


class IntegrationError(Exception):
    """Integration could not judge the model (one line; the CLI exits 1)."""


def integrate(run: RunFolder | Path, device: str | None = None, baselines: bool = True, **how) -> IntegrationResult:
    """The run integrated (`_integrate`); where the run itself cannot be (no whole-model problem,
    the tuned model failing end to end), the reason is kept in its folder for the report
    (tools/e2e.py) before the error goes on."""
    run = run if isinstance(run, RunFolder) else RunFolder.open(Path(run))
    try:
        return _integrate(run, device, baselines, **how)
    except (IntegrationError, NoWholeModel) as e:
        record_failure(run.path, str(e))
        raise


def _integrate(run: RunFolder, device: str | None = None, baselines: bool = True, *,
               max_tries: int = MAX_TRIES, limits: Limits | None = None, memory_gb: float = 8.0,
               on_note: Callable[[str], None] = lambda note: None, modes: list[str] | None = None,
               cuda_graphs: bool = True, on_step: Callable[[str], None] = lambda line: None,
               on_in_flight: Callable[[Callable[[], list[str]]], None] = lambda f: None,
               early: EarlyBaselines | None = None, reroute: bool | None = None) -> IntegrationResult:
    """`modes`: the torch.compile baselines to time (names of BASELINES; default all). `on_step`:
    a line per trial as it ends (what it was, its verdict, where its seconds went); `on_in_flight`
    gets a callable saying what the running ways are doing. `early`: the baselines started
    beside the search (agent/review/early_baselines.py); the ways it finished are not run again.
    `reroute` (default: on a GPU, where regions are judged by their kernels' device time): where
    the tuned model was slower on some workloads, every way with our kernels again with the
    original's code on those (`_rerouted`)."""
    model, folder, dev, worker_device = whole_model(run, device)
    notes = _Notes(on_note)
    if dev.type != model.device:
        notes(f"the model was frozen on {model.device} and is integrated on {dev.type}: its reference outputs "
              "come from another device")
    problems = run.problems()
    history = load_history(run, problems, [])
    dropped: list[DroppedCandidate] = []
    planned = plans(run, problems, history, max_tries, notes, dropped)
    # One worker verifies or times at a time, on the CPU too; the others only compile. On a GPU,
    # across every tuner of the host too (sandbox/device_lock.py).
    pool = DevicePool(worker_device, [folder], limits=limits or LIMITS, memory_gb=memory_gb, cpu_lock=True)
    caches = CompileCaches(run.path)  # the ways with our kernels start from their mode's baseline's
    on_in_flight(pool.in_flight)
    # One draw of fresh inputs and perturbed parameters for every check of the model here (each
    # winner routed in, then every way of running it): each worker sees the seeds only when it is
    # verified, and the reference worker computes the original's answers once, not per check
    # (with KV caches among the outputs, gigabytes per input set).
    draw = (seed(), seed())
    chosen = _compile_modes(baselines, modes, dev.type, model.seeded_calls, notes)
    it = _Integration(run=run, model=model, history=history, pool=pool, runner=pool.runners[0], caches=caches,
                      draw=draw, chosen=chosen, early=early, graphed=dev.type == "cuda" and cuda_graphs,
                      notes=notes, dropped=dropped, on_step=on_step, on_in_flight=on_in_flight)
    try:
        result = _run_ways(it, planned, dev.type == "cuda" if reroute is None else reroute)
    finally:
        pool.close()
        caches.drop_copies()
    result.save(run.path)
    return result


@dataclass
class _Notes:
    """The notes of one table, each passed on to `on_note` as it is said."""
    on_note: Callable[[str], None]
    said: list[str] = field(default_factory=list)

    def __call__(self, text: str) -> None:
        self.said.append(text)
        self.on_note(text)


def _compile_modes(baselines: bool, modes: list[str] | None, device_type: str, seeded: bool, note: _Notes) -> list[str]:
    """The torch.compile modes the model is compared against (names of BASELINES), and the notes
    on those it is not."""
    chosen = [name for name in BASELINES if modes is None or name in modes] if baselines else []
    if baselines and (left := [name for name in BASELINES if name not in chosen]):
        note(f"not compared against {', '.join(left)} (--compile-modes): the fastest way is named among the others")
    if device_type == "cpu" and not baselines:
        note("torch.compile baselines skipped: on the CPU they are slow to compile (ask for them with --baselines)")
    if seeded and chosen:
        note("the model draws random numbers, so every compiled way ran with Inductor's fallback_random "
             "(torch's own random numbers, checkable against the frozen outputs); a user's torch.compile "
             "draws Inductor's, which may be faster")
    return chosen


@dataclass
class _Integration:
    """What every step of one integration shares: the run and its whole-model problem, the device's
    pool and its first runner, the one draw of inputs, the compile modes compared against, and
    what has been noted and dropped so far."""
    run: RunFolder
    model: Problem
    history: History
    pool: DevicePool
    runner: TrialRunner
    caches: CompileCaches
    draw: tuple[int, int]
    chosen: list[str]
    early: EarlyBaselines | None
    graphed: bool  # a CUDA-graph way is run: on a GPU, unless turned off
    notes: _Notes
    dropped: list[DroppedCandidate]
    on_step: Callable[[str], None]
    on_in_flight: Callable[[Callable[[], list[str]]], None]
    seen: dict[str, CandidateRecord] = field(default_factory=dict)
    """Every winner routed so far, for what a dispatcher of them runs."""

    def compiled_routes(self, accepted: list, say: Callable[[str], None] = lambda text: None
                        ) -> dict[str, tuple[str | None, list[str]]]:
        """Inside a compiled model a region's kernel competes with the compiler's code for the
        region, not with eager: there each region keeps ours only where it beat torch.compile of
        the region (`_compiled_routes`)."""
        self.seen.update({rec.candidate_hash: rec for _, rec, _ in accepted})
        return _compiled_routes(self.run, self.history, accepted, say, self.seen) if self.chosen else {}

    def every_way(self, accepted: list[tuple[Problem, CandidateRecord, str]]) -> list[tuple[str, Candidate]]:
        return ways_of(accepted, graphed=self.graphed, baselines=self.chosen if self.early is None else [],
                       composed=self.chosen, on_step=self.on_step, eager_rng=self.model.seeded_calls,
                       compiled_routes={name: route for name, (route, _) in self.compiled_routes(accepted).items()})

    def tabulate(self, accepted: list, final: Trial, trials: dict[str, Trial], notes: _Notes) -> IntegrationResult:
        """The result of the ways run so far (`trials`), with `final` the tuned model's trial; what
        it notes goes to `notes`, whose notes it carries."""
        final, graphed, also = _nightshift_column(trials.get("graphed"), final, notes)
        if not accepted:
            notes("nothing was applied: the table times the untouched model against itself (A/A)")
        compiled = self.compiled_routes(accepted, notes)
        floors = model_floors(self.run, self.model)
        rows = [WorkloadResult(name=t.workload, weight=w.weight, eager_ms=t.baseline_ms, tuned_ms=t.candidate_ms,
                               speedup=t.speedup, noise_band=t.noise_band, verdict=t.verdict,
                               error=final.workload_errors.get(w.name), tolerance=str(self.model.tolerance_for(i)),
                               floor_ms=floors.get(w.name))
                for i, (w, t) in enumerate(zip(self.model.workloads, final.timings))]
        errors, fallbacks, dynamo = _compiled_columns(rows, trials, also)
        hello = dict(self.runner.worker.hello or self.runner.reference.hello)
        return IntegrationResult(
            device=self.pool.device, device_name=hello.get("device_name", ""), generation=hello.get("generation", ""),
            timing_kind=final.timings[0].timing_kind if final.timings else "cpu", workloads=rows,
            dropped=list(self.dropped), baseline_errors=errors, baseline_fallbacks=fallbacks, dynamo=dynamo,
            notes=list(notes.said), noise_band=final.noise_band, cuda_graph=graphed,
            accepted=[AcceptedRegion(region=p.name, candidate_hash=rec.candidate_hash,
                                     candidate_path=str(candidate_path(self.run, rec)), planner=rec.planner,
                                     template=rec.template,
                                     region_speedup=rec.score(self.history.targets(p.name)) or None,
                                     instances=len(p.instances),
                                     under_compile=compiled[p.name][1] if p.name in compiled else None)
                      for p, rec, _ in accepted])


def _run_ways(it: _Integration, planned: list, reroute: bool) -> IntegrationResult:
    """Every way of running the model with the winners routed in, verified and timed against the
    untouched model; rerouted where `reroute` and the tuned model was slower on some workloads."""
    accepted, trials = _first_routing(it, sourced(it.run, planned, it.dropped))
    if it.chosen and it.early is not None:  # started beside the search: waited for only now
        trials.update({n: t for n, t in it.early.result(it.on_in_flight).items() if n in it.chosen})
        it.on_in_flight(it.pool.in_flight)
        if missing := [w for w in baseline_ways(it.chosen, it.model.seeded_calls) if w[0] not in trials]:
            trials.update(side_by_side(it.pool, missing, it.on_step, it.draw, caches=it.caches))
    final = trials["tuned"]
    if final.status.value != "ok":
        raise IntegrationError(f"the tuned model failed when run again: {final.status.value}: {final.reason}")
    if reroute and (losing := _slower(it.model, final, accepted)):
        # The first routing's table is kept before every way compiles again: a tune stopped
        # meanwhile (its step's time, Ctrl-C) still has it.
        first = _Notes(lambda text: None, [*it.notes.said, "this is the first routing's table: the tuned model was "
                                           f"slower on {', '.join(sorted(losing))}, and integration was stopped "
                                           "while it ran every way again with the original's code there"])
        it.tabulate(accepted, final, trials, first).save(it.run.path)
        accepted, final = _rerouted(it, accepted, losing, trials)
    return it.tabulate(accepted, final, trials, it.notes)


def _first_routing(it: _Integration, candidates: list) -> tuple[list, dict[str, Trial]]:
    """Every region's best winner at once first: every way of running the model, each in a worker
    of its own, all compiling at once, nothing timed meanwhile; then each verified and timed
    against the untouched model, one after another. Only when that tuned model fails end to end
    are the winners routed in one by one (errors that compound), and every way run with those."""
    accepted = [(p, *readable[0]) for p, readable in candidates]
    it.runner.worker.kill()
    trials = side_by_side(it.pool, it.every_way(accepted), it.on_step, it.draw,
                          keep_answers=True, first_must_pass=bool(accepted), caches=it.caches)
    if accepted and trials["tuned"].status.value != "ok":
        it.on_step(f"the winners together failed end to end ({_end_to_end(trials['tuned'])}): routed in one by one")
        accepted = _one_by_one(it.runner, candidates, it.draw, it.dropped, it.on_step)
        it.runner.worker.kill()
        trials = side_by_side(it.pool, it.every_way(accepted), it.on_step, it.draw, caches=it.caches)
    return accepted, trials


def _nightshift_column(graphed_way: Trial | None, final: Trial, say: Callable[[str], None]
                       ) -> tuple[Trial, bool, dict[str, Trial]]:
    """The trial of the nightshift column (the tuned model's CUDA-graph capture, where that was
    faster beyond the band), whether it is the graphed one, and the other way as a column of its
    own (it may be the faster on some workloads)."""
    graphed = False
    also: dict[str, Trial] = {}
    if (g := graphed_way) is not None:
        if g.status.value == "ok" and g.speedup and final.speedup and \
                g.speedup > final.speedup * (1 + (g.noise_band or 0.0)):
            also[UNGRAPHED_WAY] = final
            final, graphed = g, True
            say("the tuned model captured in a CUDA graph per workload shape was faster: it is the one timed "
                f"(without the graphs: '{UNGRAPHED_WAY}')")
        elif g.status.value == "ok":
            also[GRAPHED_WAY] = g
        else:
            say(f"CUDA-graph capture of the tuned model failed: {g.status.value}: {g.reason}")
    return final, graphed, also


def _compiled_columns(rows: list[WorkloadResult], trials: dict[str, Trial], also: dict[str, Trial]
                      ) -> tuple[dict[str, str], dict[str, str], dict[str, dict]]:
    """Each compile mode's way, ours inside each, and `also` as columns of `rows`; returns the
    ways' errors, where a compiled one ran eager and why, and dynamo's counts per compiled way."""
    errors: dict[str, str] = {}
    fallbacks: dict[str, str] = {}
    dynamo: dict[str, dict] = {}
    for way, b in ({w: trials.get(w) for w in [*BASELINES, *map(composed_name, BASELINES)]} | also).items():
        if b is None:
            continue
        name, compiled_way = way, way not in also
        if b.dynamo and compiled_way:
            dynamo[way] = b.dynamo
        # A compiled way that ran eager is never called by the compiler's name.
        if compiled_way and (why := b.compile_fallback) and (way in BASELINES or why.startswith("fell back")):
            name = f"{way} (ran eager)" if why.startswith("fell back") else f"{way} (partly eager)"
            fallbacks[name] = why
        if b.status.value != "ok":
            errors[name] = f"{b.status.value}: {b.reason}"
        for row, t in zip(rows, b.timings if b.status.value == "ok" else [None] * len(rows)):
            row.baselines[name] = t.candidate_ms if t else None
            row.baseline_speedups[name] = t.speedup if t else None
            row.baseline_bands[name] = t.noise_band if t else None
    return errors, fallbacks, dynamo


def _compiled_routes(run: RunFolder, history: History, accepted: list, note: Callable[[str], None],
                     made: dict[str, CandidateRecord]) -> dict[str, tuple[str | None, list[str]]]:
    """Per accepted region with a kept torch.compile candidate to judge its winner by
    (agent/dispatch.left_to_the_compiler): its source inside the compiled ways (None: its own code
    on every call, compiled with the rest) and the input shapes left to its own code there ("*":
    every call), as `agent apply`'s compile_model does them. `made`: winners integration built
    (per-shape dispatchers), by hash. What each region runs there is noted."""
    routes: dict[str, tuple[str | None, list[str]]] = {}
    for p, rec, source in accepted:
        if rec.template == "torch_compile":
            continue  # never nested in a compiled model: its own code runs there already
        gens = history.targets(p.name)
        theirs = dispatch.left_to_the_compiler(p, history.kept(p.name), gens, rec, made)
        if not theirs:
            continue  # nothing to judge by, or ours was faster on every workload
        if len(theirs) >= len(p.workloads):
            routes[p.name] = (None, ["*"])
            note(f"{p.name}: torch.compile of the region was as fast as our kernel on every workload, so inside "
                 "the compiled ways its own code runs, compiled with the rest")
            continue
        got = dispatch.without_workloads(run, p, rec, source, theirs)
        if got is None:
            continue  # its inputs unreadable: the winner as in the eager model
        keys = dispatch.input_keys(p, run.problems_dir / p.name)
        routes[p.name] = (got[1], [k for w, k in zip(p.workloads, keys) if w.name in theirs])
        note(f"{p.name}: inside the compiled ways our kernel runs on "
             f"{', '.join(w.name for w in p.workloads if w.name not in theirs)} only, and its own code, compiled "
             f"with the rest, on {', '.join(w.name for w in p.workloads if w.name in theirs)} (torch.compile of "
             "the region was as fast there, or the winner leaves them to the original)")
    ours = [p.name for p, rec, _ in accepted if rec.template != "torch_compile"]
    if ours and all(n in routes and routes[n][0] is None for n in ours):
        note("no kernel of ours beat torch.compile of its region: the compiled ways with our kernels would be "
             "the compile modes themselves, so they are not run")
    return routes


def _slower(model: Problem, final: Trial, accepted: list) -> set[str]:
    """Workloads where the model with our kernels was slower than the original beyond the band,
    when others were not: there the original's code should run (its regions were judged by their
    kernels' device time; a host-bound model pays each routed call's Python too). A tie is left
    as it is: on the H100 (2026-12-06) noisy ties on the example's prefill and small batch (bands
    of 50% and 96%) sent every way to be compiled again, and the tune ran out of its step."""
    if not accepted:
        return set()
    names = {w.name for w, t in zip(model.workloads, final.timings) if t.verdict == "slower"}
    return names if len(names) < len(final.timings) else set()


def _rerouted(it: _Integration, accepted: list, losing: set[str], trials: dict[str, Trial]) -> tuple[list, Trial]:
    """Every way with our kernels again, each region's winner now leaving the `losing` workloads'
    shapes to the original (agent/dispatch.without_workloads); kept where the tuned model passes
    again, in place of the first ways (`trials` updated). Returns the accepted winners and the
    tuned model's trial."""
    rerouted, changed = [], False
    for p, rec, source in accepted:
        got = dispatch.without_workloads(it.run, p, rec, source, losing)
        rerouted.append((p, *got) if got else (p, rec, source))
        changed = changed or got is not None
    said = ", ".join(sorted(losing))
    if not changed:
        it.notes(f"our kernels were slower end to end on {said}; no region's workloads could leave them "
                 "to the original's code")
        return accepted, trials["tuned"]
    it.on_step(f"slower end to end on {said}: every way with our kernels again, the original's code there")
    # A compiled way whose regions all run their compiler-judged route (_compiled_routes) is unchanged.
    first = dict(it.every_way(accepted))
    ways = [w for w in it.every_way(rerouted) if w[0] not in BASELINES]
    again = side_by_side(it.pool, [(n, c) for n, c in ways if n not in first or first[n].source != c.source],
                         it.on_step, it.draw, caches=it.caches)
    if again["tuned"].status.value != "ok":
        it.notes(f"slower end to end on {said}; leaving the original's code there failed "
                 f"({_end_to_end(again['tuned'])}): the first routing is timed")
        return accepted, trials["tuned"]
    kept = {n for n, c in ways if n not in again}
    for way in [w for w in trials if (w == "graphed" or w.startswith(composed_name(""))) and w not in kept]:
        trials.pop(way)  # of the first routing: replaced, or gone where no kernel is left
    trials.update(again)
    it.notes(f"our kernels were slower end to end on {said}: the original's code runs there "
             "(the regions were judged by their kernels' device time)")
    return rerouted, again["tuned"]


def _one_by_one(runner: TrialRunner, candidates: list, draw: tuple[int, int], dropped: list[DroppedCandidate],
                on_step: Callable[[str], None]) -> list[tuple[Problem, CandidateRecord, str]]:
    """Each region's winners routed in after the ones accepted so far, best first, verified end
    to end (untimed): the first that passes is accepted, the others are dropped with the reason."""
    accepted: list[tuple[Problem, CandidateRecord, str]] = []
    runner.verify_seeds = draw
    try:
        for p, readable in candidates:
            for rec, source in readable:
                trial = runner.run(routed_candidate([(q, s) for q, _, s in accepted] + [(p, source)]), do_time=False)
                on_step(f"{p.name} {rec.candidate_hash} routed in: {trial.status.value} end to end; {phases(trial)}")
                if trial.status.value == "ok":
                    accepted.append((p, rec, source))
                    break
                dropped.append(DroppedCandidate(region=p.name, candidate_hash=rec.candidate_hash,
                                                reason=_end_to_end(trial)))
    finally:
        runner.verify_seeds = None
    return accepted


def _end_to_end(trial: Trial) -> str:
    if trial.status.value == "wrong":
        return f"end-to-end {trial.reason}"
    return f"{trial.status.value}: {trial.reason}"
