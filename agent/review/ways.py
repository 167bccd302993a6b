"""The ways of running a whole model that integration times, and how they are run.

Each way is a candidate for the run's whole-model problem: the model with winners routed in
(eagerly, captured in CUDA graphs, or under torch.compile as opaque ops), or torch.compile of
the untouched model in one mode. `side_by_side` runs several, each in a worker of its own, all
compiling at once with nothing timed meanwhile, then each verified and timed one after
another. Integration (agent/review/integrate.py) and the compile baselines started beside a search
(agent/review/early_baselines.py) both run their ways here.
"""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from agent.review.compile_caches import CompileCaches
from agent.errors import UserError
from agent.flags import BASELINES
from agent.setup.jobs import resolve_device
from agent.prompting import render_code
from sandbox.pool import DevicePool
from sandbox.runner import Limits, TrialRunner, seed
from tools.capture_model import MODEL_DIR, WHOLE_MODEL
from tools.modelfile import file_sha256
from tools.problem import Problem, ProblemError
from tools.runfolder import RunFolder
from tools.trial import Candidate, Trial

if TYPE_CHECKING:
    from agent.history import CandidateRecord
    import torch

LIMITS = Limits(compile_s=900, run_s=900, time_s=600)
"""A way of running the whole model may compile for minutes (max-autotune)."""


def composed_name(baseline: str) -> str:
    """The way of running our kernels inside a compile mode: 'nightshift + reduce-overhead'."""
    return f"nightshift + {baseline}"


def routed_candidate(routes: list[tuple[Problem, str]]) -> Candidate:
    """The whole model with each (region problem, winner source) routed into every instance of
    the region's class."""
    source = render_code("kernels/route_model.py.j2",
                         routes=[{"cls": p.region_class, "source": src} for p, src in routes])
    return Candidate(region="model", source=source, planner="integrate",
                     params={"routes": {p.region_class: hashlib.sha256(src.encode()).hexdigest()[:16]
                                        for p, src in routes}})


def graphed_candidate(routes: list[tuple[Problem, str]]) -> Candidate:
    """The same routed model, captured in a CUDA graph per input shape and replayed with the
    inputs copied in (a replay that read stale inputs would be wrong, and is judged so); inputs
    it writes in place that come at the same address again (a KV cache) are captured on as they
    are, not copied in and out."""
    source = render_code("kernels/route_model_graphed.py.j2",
                         routes=[{"cls": p.region_class, "source": src} for p, src in routes])
    return Candidate(region="model", source=source, planner="integrate", template="cuda_graph",
                     params={"routes": {p.region_class: hashlib.sha256(src.encode()).hexdigest()[:16]
                                        for p, src in routes}, "cuda_graph": True})


def composed_candidate(routes: list[tuple[Problem, str]], mode: str | None, eager_rng: bool = False) -> Candidate:
    """The routed model under torch.compile: each winner an opaque custom op the compiler fuses
    around (and, with reduce-overhead, captures in its CUDA graphs). `eager_rng`: the model
    draws random numbers (compiled with fallback_random, so they are torch's)."""
    source = render_code("kernels/route_model_compiled.py.j2", mode=mode, eager_rng=eager_rng,
                         routes=[{"cls": p.region_class, "source": src} for p, src in routes])
    return Candidate(region="model", source=source, planner="integrate", template="torch_compile",
                     params={"routes": {p.region_class: hashlib.sha256(src.encode()).hexdigest()[:16]
                                        for p, src in routes}, "mode": mode})


def ways_of(accepted: list[tuple[Problem, CandidateRecord, str]], graphed: bool, baselines: list[str],
            composed: list[str], on_step: Callable[[str], None] = lambda line: None,
            eager_rng: bool = False, compiled_routes: dict[str, str | None] | None = None
            ) -> list[tuple[str, Candidate]]:
    """The ways of running the model with the accepted (region problem, record, source) winners:
    the tuned model, its CUDA-graph capture (`graphed`), the compile `baselines` named and
    each `composed` mode with our kernels inside (`eager_rng`: see compile_candidate).
    `compiled_routes`: region name -> its source inside a compiled model (None: the region's own
    code, compiled with the rest), for the regions judged against torch.compile of the region
    (agent/integrate._compiled_routes); the others run their winner there too."""
    routes = [(q, s) for q, _, s in accepted]
    ways: list[tuple[str, Candidate]] = [("tuned", routed_candidate(routes))]
    # A winner that is torch.compile of its region is not nested in another capture or compile
    # (cudagraph trees inside a capture fail, and a compile during one leaves the worker's CUDA
    # generator in capture mode: the H200 lost two ways of transformers' LlamaModel to it).
    # There the region's own code runs, which the outer compiler compiles anyway.
    kernels = [(q, s) for q, rec, s in accepted if rec.template != "torch_compile"]
    if left := sorted(q.name for q, rec, _ in accepted if rec.template == "torch_compile"):
        on_step(f"{', '.join(left)}: the winner is torch.compile of the region; in the CUDA-graph and "
                "compiled ways the region's own code runs")
    if graphed and kernels:  # the integration step for launch-bound workloads
        ways.append(("graphed", graphed_candidate(kernels)))
    ways += baseline_ways(baselines, eager_rng)
    inside = [(q, (compiled_routes or {}).get(q.name, s)) for q, s in kernels]
    inside = [(q, s) for q, s in inside if s is not None]
    if inside:  # our kernels inside the compiled model, the way a torch.compile user runs it
        ways += [(composed_name(name), composed_candidate(inside, BASELINES[name], eager_rng)) for name in composed]
    return ways


def compile_candidate(mode: str | None, eager_rng: bool = False) -> Candidate:
    """torch.compile of the untouched model in `mode`. `eager_rng`: the model draws random numbers
    (its whole-model problem is `seeded_calls`); Inductor's own generator would draw other ones
    and fail the check, so it compiles with fallback_random (integration says so)."""
    source = render_code("kernels/torch_compile.py.j2", mode=mode, options={}, eager_rng=eager_rng)
    return Candidate(region="model", source=source, planner="torch.compile", template="torch_compile",
                     params={"mode": mode, **({"eager_rng": True} if eager_rng else {})})


class NoWholeModel(UserError):
    """The run has no whole-model problem: nothing can be timed end to end."""


def whole_model(run: RunFolder, device: str | None) -> tuple[Problem, Path, torch.device, str]:
    """The run's whole-model problem, its folder, the device to run it on and that device's
    worker name; a UserError when the problem or its model file is gone or changed."""
    folder = run.path / MODEL_DIR
    try:
        model = Problem.load(folder)
    except ProblemError as e:
        if why := run.info().skipped.get(WHOLE_MODEL):  # the freeze said why it made none
            raise NoWholeModel(f"this run has no whole-model problem, so nothing can be timed end to end: {why}") from None
        raise NoWholeModel(f"{e} (this run has no whole-model problem: profile the model again)") from None
    if not Path(model.model_file).is_file():
        raise UserError(f"{model.model_file}: the model file of this run is gone")
    if file_sha256(Path(model.model_file)) != model.model_hash:
        raise UserError(f"{model.model_file} changed since the run was frozen (hash mismatch): profile again")
    dev = resolve_device(device or model.device)
    return model, folder, dev, "cpu" if dev.type == "cpu" else f"cuda:{dev.index or 0}"


def baseline_ways(modes: list[str] | None, eager_rng: bool = False) -> list[tuple[str, Candidate]]:
    """torch.compile of the untouched model in each chosen mode (names of BASELINES; None: all)."""
    return [(name, compile_candidate(mode, eager_rng)) for name, mode in BASELINES.items()
            if modes is None or name in modes]


PARALLEL_LOADS = 8
"""Ways of running the model compiled at once (each a worker holding the model on the device):
the usual eight (tuned, its CUDA-graph capture, three compile modes, each with our kernels
inside) in one batch, since a second batch waits out another compile of minutes."""


def side_by_side(pool: DevicePool, ways: list[tuple[str, Candidate]], on_step: Callable[[str], None],
                  draw: tuple[int, int] | None = None, keep_answers: bool = False,
                  first_must_pass: bool = False, caches: CompileCaches | None = None) -> dict[str, Trial]:
    """Each way in a fresh worker of its own (the first in the pool's runner, the rest in the
    pool's extra runners, which share its reference worker and device lock): preloaded in
    batches of PARALLEL_LOADS, then each batch verified and timed one by one, every way on the
    one draw of fresh inputs and perturbed parameters `draw` (a new one when not given). The
    reference worker's answers for it are dropped after, unless `keep_answers`. With
    `first_must_pass`, the others are not verified or timed when the first way fails. `caches`:
    the compile caches each way's worker starts from (agent/review/compile_caches.py)."""
    runner = pool.runners[0]
    trials: dict[str, Trial] = {}
    draw = draw or (seed(), seed())

    def first_failed() -> bool:
        first = trials.get(ways[0][0]) if ways else None
        return first_must_pass and first is not None and first.status.value != "ok"
    try:
        for at in range(0, len(ways), PARALLEL_LOADS):
            batch = ways[at:at + PARALLEL_LOADS]
            own = [runner] if at == 0 else []
            with pool.extra_runners(len(batch) - len(own)) as extra:  # closed after, also when a way raised
                runners = own + extra
                for r in runners:
                    r.verify_seeds = draw
                _batch(runners, batch, trials, on_step, keep=runner, stop=first_failed, caches=caches)
                if first_failed():
                    break
    finally:
        runner.verify_seeds = None
        if runner.config.compile_cache is not None:  # a batch stopped before its trial closed it
            runner.worker.close()
            runner.config.compile_cache = runner.config.compile_cache_at = None
        if not keep_answers:
            pool.reference.kept.clear()
    return trials


def _batch(runners: list[TrialRunner], batch: list[tuple[str, Candidate]], trials: dict[str, Trial],
           on_step: Callable[[str], None], keep: TrialRunner, stop: Callable[[], bool] = lambda: False,
           caches: CompileCaches | None = None) -> None:
    """Preload the batch's ways at once, then verify and time each; every worker but `keep`'s
    is closed after its trial, so its device memory goes before the next one times, and so is
    one that compiled into a cache folder (never reused for anything else)."""
    for r, (name, _) in zip(runners, batch):
        folder, at = (caches.folder(name) if caches is not None else None) or (None, None)
        if folder is not None or r.config.compile_cache is not None:
            r.worker.kill()  # a worker is started for its cache, and never reused
            r.config.compile_cache, r.config.compile_cache_at = folder, at
        if caches is not None and name in caches.said:
            on_step(caches.said.pop(name))
    t0 = time.monotonic()
    loads = [threading.Thread(target=r.preload, args=(c,), daemon=True) for r, (_, c) in zip(runners, batch)]
    for t in loads:
        t.start()
    try:
        for t in loads:
            t.join()
    except BaseException:  # a signal (the tuner stops): no preload may leave a worker behind
        for r in runners:
            r.worker.kill()  # unblocks a preload waiting on its worker
        for t in loads:
            t.join(timeout=30)
        for r in runners:
            r.worker.kill()  # one a preload started meanwhile
        raise
    on_step(f"compiled {', '.join(n for n, _ in batch)} side by side in {time.monotonic() - t0:.0f}s")
    for r, (name, c) in zip(runners, batch):
        if stop():
            break
        trial = trials[name] = r.run(c)
        # Each workload's numbers as soon as they exist: a run stopped later still has them.
        per = "\n    ".join(f"{t.workload} {t.baseline_ms:.4g} -> {t.candidate_ms:.4g} ms ±{t.noise_band:.1%} "
                            f"({t.band_parts()})" for t in trial.timings)
        on_step(f"{name}: {trial.status.value}" + (f" {trial.speedup:.3f}x" if trial.speedup else "")
                + (f" ({trial.reason[:100]})" if trial.status.value != "ok" else "") + f"; {phases(trial)}"
                + (f"; Inductor's graph cache {d['fx_cache_hits']} hits, {d.get('fx_cache_misses', 0)} misses"
                   if (d := trial.dynamo) and "fx_cache_hits" in d else "")
                + "".join(f"\n    {flag}" for flag in trial.flags)
                + (f"\n    {per}" if per else ""))
        if r is not keep or r.config.compile_cache is not None:
            r.worker.close()
            r.config.compile_cache = r.config.compile_cache_at = None


def phases(trial: Trial) -> str:
    """Where a trial's seconds went ("start 19s, load 47s, verify 42s, refs 20s, time 3s")."""
    return ", ".join(f"{k} {v:.1f}s" if v < 10 else f"{k} {v:.0f}s" for k, v in trial.phases.items() if v >= 0.05)
