"""Per input shape, the fastest kept candidate: one region candidate built from several.

The search ranks a region's candidates by their weighted speedup over every workload, so one
winner serves every shape: a decode kernel that is 12x on decode and no faster on prefill loses
to a prefill kernel that is 1.5x on prefill and 2x on decode. Here each workload gets the kept
candidate that was fastest on it beyond its noise band (on every target generation), or the
original where none was, and `prompts/kernels/dispatch_by_shape.py.j2` routes each call by its
input shapes. Every kernel in it passed verification on every workload; integration verifies and
times the combination end to end like any other candidate.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from agent.history import CandidateRecord
from agent.prompting import render_code
from tools.objects import rebuild
from tools.problem import Problem, ProblemError
from tools.runfolder import RunFolder


def _shapes(x: Any, out: list[str]) -> list[str]:
    if isinstance(x, torch.Tensor):
        out.append(f"{tuple(x.shape)}:{str(x.dtype).removeprefix('torch.')}")
    elif isinstance(x, (list, tuple)):
        for v in x:
            _shapes(v, out)
    elif isinstance(x, dict):
        for k in sorted(x, key=str):
            _shapes(x[k], out)
    return out


def shape_key(args: Any, kwargs: Any) -> str:
    """The key the dispatcher computes per call (the template's `_key`, kept the same by a test)."""
    return "|".join(_shapes(kwargs, _shapes(args, [])))


@dataclass
class ShapeChoice:
    workload: str
    key: str
    record: CandidateRecord | None
    """The fastest kept candidate on this workload beyond its band; None: the original."""
    speedup: float = 1.0


def per_workload(problem: Problem, records: list[CandidateRecord], generations: list[str],
                 keys: list[str]) -> list[ShapeChoice]:
    """Per workload (key i is input set i's shape key), the candidate to run there."""
    out = []
    for i, w in enumerate(problem.workloads):
        best, best_s = None, 1.0
        for rec in records:
            if not rec.kept(generations):
                continue
            got = [next((t for t in rec.by_generation[g].timings if t.workload == w.name), None) for g in generations]
            if any(t is None or t.verdict != "faster" for t in got):
                continue
            s = min(t.speedup for t in got)
            if s > best_s:
                best, best_s = rec, s
        out.append(ShapeChoice(w.name, keys[i], best, best_s))
    return out


def worth_it(choices: list[ShapeChoice], single: CandidateRecord | None) -> bool:
    """Whether dispatching by shape differs from running `single` (the region's winner) everywhere."""
    return any(c.record is not single for c in choices) and any(c.record is not None for c in choices)


def input_keys(problem: Problem, folder: Path) -> list[str]:
    """Per input set, the key the dispatcher computes when the region is called with it: objects
    frozen as markers (transformers' caches, tools/objects.py) are rebuilt first, as the call sees
    them. A marker is a dict of the cache's tensors, which `_shapes` reads; the Cache object the
    model passes is neither, and `_shapes` skips it: keyed on the markers, no workload of an
    attention fed a Cache matched its row, and every call ran the dispatcher's default, the
    shapes it routes to the original included (H100, transformers' LlamaModel, 2026-12-07)."""
    inputs, _, _ = problem.load_tensors(folder, inputs=True, state=False)
    return [shape_key(rebuild(list(s["args"])), rebuild(dict(s["kwargs"]))) for s in inputs]


def dispatch_source(choices: list[ShapeChoice], sources: dict[str, str], default: CandidateRecord | None) -> str:
    """The dispatcher's source. `sources`: candidate hash -> its source, for every chosen record."""
    used = list(dict.fromkeys([c.record.candidate_hash for c in choices if c.record is not None]
                              + ([default.candidate_hash] if default is not None else [])))
    index = {h: i for i, h in enumerate(used)}
    table: dict[str, int | None] = {}
    for c in choices:
        pick = index[c.record.candidate_hash] if c.record is not None else None
        if table.get(c.key, pick) != pick:  # two workloads of one shape disagree: the default serves both
            pick = index[default.candidate_hash] if default is not None else None
        table[c.key] = pick
    return render_code("kernels/dispatch_by_shape.py.j2", kernels=[sources[h] for h in used],
                       table=[{"key": k, "kernel": v} for k, v in table.items()],
                       default=index[default.candidate_hash] if default is not None else None)


def source_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def region_dispatcher(run: RunFolder, p: Problem, kept: list[CandidateRecord], gens: list[str],
                      single: CandidateRecord | None, source_of: Callable[[CandidateRecord], str | None]
                      ) -> tuple[CandidateRecord, float] | None:
    """The region's per-shape dispatcher over its kept candidates (above), saved with
    the run's candidates, and its expected speedup from their own per-workload timings; None where
    one candidate (or none) is best on every workload."""
    try:
        choices = per_workload(p, kept, gens, input_keys(p, run.problems_dir / p.name))
    except (ProblemError, OSError, KeyError):
        return None
    if not worth_it(choices, single):
        return None
    sources = {}
    for rec in [c.record for c in choices if c.record] + ([single] if single else []):
        source = source_of(rec)
        if source is None:
            return None
        sources[rec.candidate_hash] = source
    source = dispatch_source(choices, sources, single)
    digest = source_hash(source)
    run.save_candidate(source, digest)
    rec = CandidateRecord(p.name, digest, "dispatch_by_shape",
                          {"by_workload": {c.workload: c.record.candidate_hash if c.record else "original"
                                           for c in choices}}, "integrate")
    w = p.weights
    base = new = 0.0
    for c in choices:
        t = next((t for r in kept for t in r.by_generation[gens[0]].timings if t.workload == c.workload), None)
        if t is not None:
            base, new = base + w[c.workload] * t.baseline_ms, new + w[c.workload] * t.baseline_ms / c.speedup
    return rec, (base / new if new > 0 else 1.0)


def without_workloads(run: RunFolder, p: Problem, rec: CandidateRecord, source: str,
                      losing: set[str]) -> tuple[CandidateRecord, str] | None:
    """`rec` (a region's accepted winner, whose `source` it is) on every workload but those in
    `losing`, where the original runs: the model with our kernels was slower end to end
    there (integration). Shapes no workload has run `rec`, as before. None where no workload is
    left to it, none of the region's is in `losing`, or its inputs are unreadable."""
    try:
        keys = input_keys(p, run.problems_dir / p.name)
    except (ProblemError, OSError, KeyError):
        return None
    choices = [ShapeChoice(w.name, keys[i], None if w.name in losing else rec) for i, w in enumerate(p.workloads)]
    if all(c.record is None for c in choices) or all(c.record is not None for c in choices):
        return None  # nothing left to it, or no workload of this region lost
    source = dispatch_source(choices, {rec.candidate_hash: source}, rec)  # other shapes: as before
    digest = source_hash(source)
    run.save_candidate(source, digest)
    # A compile winner stays one: integration keeps it out of CUDA-graph and compiled ways.
    template = rec.template if rec.template == "torch_compile" else "dispatch_by_shape"
    return CandidateRecord(p.name, digest, template,
                           {"by_workload": {c.workload: rec.candidate_hash if c.record else "original"
                                            for c in choices}}, "integrate"), source


def _on(rec: CandidateRecord, workload: str, generations: list[str]) -> tuple[float, float] | None:
    """`rec`'s speedup on one workload (its smallest over the generations) and its widest band there."""
    got = [next((t for t in rec.by_generation[g].timings if t.workload == workload), None) for g in generations]
    if any(t is None for t in got):
        return None
    return min(t.speedup for t in got), max(t.noise_band for t in got)


def left_to_the_compiler(problem: Problem, kept: list[CandidateRecord], generations: list[str],
                         rec: CandidateRecord, made: dict[str, CandidateRecord] | None = None) -> set[str] | None:
    """The region's workloads where, inside a compiled model, its own code should run (compiled
    with the rest) rather than what its winner `rec` runs there: torch.compile of the region (its
    best kept compile candidate) was as fast beyond both bands, or the winner runs no kernel of
    ours there. None where no compile candidate was kept: nothing to judge by. The regions were
    timed apart, so this judges the compiled model's region only up to its edges, where the
    compiler's fusion with the code around it would add to its side. `made`: per-shape
    dispatchers integration built (no trials of their own), by hash: what they run is looked up."""
    compiled = [r for r in kept if r.template == "torch_compile" and r.kept(generations)]
    if not compiled:
        return None
    by_hash = {**(made or {}), **{r.candidate_hash: r for r in kept}}
    out = set()
    for w in problem.workloads:
        runs = rec
        for _ in range(len(by_hash) + 1):  # a per-shape dispatcher integration made: what it runs here
            if runs is None or runs.by_generation:
                break
            runs = by_hash.get((runs.params.get("by_workload") or {}).get(w.name, ""))
        if runs is None or runs.template == "torch_compile":
            out.add(w.name)  # the region's own code or torch.compile of it: the compiler's either way
            continue
        ours = _on(runs, w.name, generations)
        rival = max((x for x in (_on(r, w.name, generations) for r in compiled) if x is not None), default=None)
        if ours is not None and rival is not None and ours[0] <= rival[0] * (1 + max(ours[1], rival[1])):
            out.add(w.name)
    return out
