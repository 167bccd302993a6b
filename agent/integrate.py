"""Integration: the search's winners applied to the whole model, checked and timed end to end.

    regions, by expected gain (share of model x (1 - 1/speedup)):
        for its kept candidates faster than the original, best first (at most 3):
            the whole model with the accepted set plus this one, run in a sandbox worker
            within the end-to-end tolerance on every workload?  accept it, next region
            otherwise: dropped, with the reason; try the next best
    the final tuned model timed against the untouched one (same worker, interleaved),
    and torch.compile baselines against eager, when asked

Candidate code runs only in sandbox workers (sandbox/integrator.py); this process holds
the frozen model outputs (`runs/<run>/model/`) and decides. The result is
`runs/<run>/integration.json` (tools/e2e.py).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

from agent.history import CandidateRecord
from agent.jobs import UserError, resolve_device
from agent.loop import load_history
from sandbox.client import Reply, WorkerConfig
from sandbox.integrate_op import BASELINES
from sandbox.integrator import IntegrateLimits, Integrator
from tools.capture import MODEL_DIR, ModelReference
from tools.e2e import AcceptedRegion, DroppedCandidate, IntegrationResult, WorkloadResult
from tools.integrate import E2ECheck, expected_gain, judge, untouched_drift
from tools.modelfile import file_sha256
from tools.problem import Problem, tensor_hash
from tools.runfolder import RunFolder

MAX_TRIES = 3
"""Kept candidates tried per region, best first."""
NOT_FASTER = "not faster than the original"


class IntegrationError(Exception):
    """Integration could not judge the model (one line; the CLI exits 1)."""


def integrate(run: RunFolder | Path, device: str | None = None, baselines: bool = True, *,
              max_tries: int = MAX_TRIES, limits: IntegrateLimits | None = None, memory_gb: float = 8.0,
              on_note: Callable[[str], None] = lambda note: None) -> IntegrationResult:
    run = run if isinstance(run, RunFolder) else RunFolder.open(Path(run))
    folder = run.path / MODEL_DIR
    ref = ModelReference.load(folder)
    if not Path(ref.model_file).is_file():
        raise UserError(f"{ref.model_file}: the model file of this run is gone")
    if file_sha256(Path(ref.model_file)) != ref.model_hash:
        raise UserError(f"{ref.model_file} changed since the run was frozen (hash mismatch): profile again")
    _, inputs, frozen = ref.load_tensors(folder, state=False)
    input_hashes = [tensor_hash(s) for s in inputs]
    out_bytes = [[t.numel() * t.element_size() for t in f["outputs"] if t is not None] for f in frozen]
    dev = resolve_device(device or ref.device)
    worker_device = "cpu" if dev.type == "cpu" else f"cuda:{dev.index or 0}"
    notes: list[str] = []

    def note(text: str) -> None:
        notes.append(text)
        on_note(text)

    if dev.type != ref.device:
        note(f"the model was frozen on {ref.device} and is integrated on {dev.type}: its reference outputs "
             "come from another device")
    problems = run.problems()
    history = load_history(run, problems, [])
    accepted: list[tuple[Problem, CandidateRecord, dict, int]] = []
    dropped: list[DroppedCandidate] = []
    plans = []
    for p in problems:
        gens = history.targets(p.name)
        kept = history.kept(p.name)
        if not kept:
            note(f"{p.name}: no candidate passed on every target generation; the original stays")
            continue
        faster = [r for r in kept if r.score(gens) > 1.0]
        if not faster:
            dropped.append(DroppedCandidate(region=p.name, candidate_hash=kept[0].candidate_hash,
                                            reason=f"{NOT_FASTER} (best kept {kept[0].score(gens):.2f}x)"))
            continue
        plans.append((expected_gain(p.share_of_model, faster[0].score(gens)), faster[0].score(gens), p, faster, gens))
    plans.sort(key=lambda x: (-x[0], -x[1]))

    integ = Integrator(folder, ref.model_file, worker_device, limits,
                       WorkerConfig(device=worker_device, memory_gb=memory_gb,
                                    triton_cache=str(run.path / ".triton-cache")))
    checked_untouched = False

    def try_set(cands: list[dict], time_it: bool = False) -> tuple[Reply, E2ECheck | None]:
        nonlocal checked_untouched
        reply = integ.run(cands, out_bytes, untouched_outputs=not checked_untouched, time_it=time_it)
        if not reply.ok and reply.header.get("phase") == "untouched":
            raise IntegrationError(f"the untouched model could not be built and run from {folder} in the sandbox: "
                                   f"{reply.status}: {_first_line(reply.error)}")
        if not reply.ok:
            return reply, None
        if not checked_untouched:
            drift = untouched_drift(ref, frozen, reply.tensors["untouched"])
            if drift:
                raise IntegrationError(drift)
            checked_untouched = True
        return reply, judge(ref, frozen, input_hashes, reply.header, reply.tensors, dev.type)

    try:
        for _, _, p, faster, gens in plans:
            for rec in faster[:max_tries]:
                source, why = _source(run, rec)
                if source is None:
                    dropped.append(DroppedCandidate(region=p.name, candidate_hash=rec.candidate_hash, reason=why))
                    continue
                cand = {"region_class": p.region_class, "source": source, "hash": rec.candidate_hash}
                reply, check = try_set([a[2] for a in accepted] + [cand])
                if check is None:
                    dropped.append(DroppedCandidate(region=p.name, candidate_hash=rec.candidate_hash,
                                                    reason=f"{reply.status}: {_first_line(reply.error)}"))
                    continue
                if not check.ok:
                    dropped.append(DroppedCandidate(region=p.name, candidate_hash=rec.candidate_hash,
                                                    reason=check.reason))
                    continue
                accepted.append((p, rec, cand, reply.header["routed"].get(p.region_class, 0)))
                break
        reply, check = try_set([a[2] for a in accepted], time_it=True)
        if check is None:
            raise IntegrationError(f"the final tuned model could not be timed: {reply.status}: "
                                   f"{_first_line(reply.error)}")
        if not check.ok:
            raise IntegrationError(f"the final tuned model failed when run again: {check.reason}")
        timings = reply.header["timings"]
        kind = reply.header.get("timing_kind", "cpu")
        hello = dict(integ.hello)
        rows = [WorkloadResult(name=w.name, weight=w.weight, eager_ms=t["eager"]["median_ms"],
                               tuned_ms=t["tuned"]["median_ms"],
                               speedup=t["eager"]["median_ms"] / max(t["tuned"]["median_ms"], 1e-12),
                               error=check.errors.get(w.name), tolerance=str(w.tolerance))
                for w, t in zip(ref.workloads, timings)]
        errors: dict[str, str] = {}
        if baselines:
            for name in BASELINES:
                b = integ.baseline(name)
                got = b.header.get("baselines", {}).get(name) if b.ok else None
                if got is None:
                    errors[name] = (b.header.get("baseline_errors", {}).get(name) if b.ok else None) or \
                        f"{b.status}: {_first_line(b.error)}"
                for i, row in enumerate(rows):
                    t = got["timings"][i] if got else None
                    row.baselines[name] = t["compiled"]["median_ms"] if t else None
                    row.baseline_speedups[name] = (t["eager"]["median_ms"] / max(t["compiled"]["median_ms"], 1e-12)
                                                   if t else None)
        elif dev.type == "cpu":
            note("torch.compile baselines skipped: on the CPU they are slow to compile (ask for them with --baselines)")
    finally:
        integ.close()
    result = IntegrationResult(
        device=worker_device, device_name=hello.get("device_name", ""), generation=hello.get("generation", ""),
        timing_kind=kind, workloads=rows, dropped=dropped, baseline_errors=errors, notes=notes,
        accepted=[AcceptedRegion(region=p.name, candidate_hash=rec.candidate_hash,
                                 candidate_path=str(_path(run, rec)), planner=rec.planner, template=rec.template,
                                 region_speedup=rec.score(history.targets(p.name)), instances=n)
                  for p, rec, _, n in accepted])
    result.save(run.path)
    return result


def _path(run: RunFolder, rec: CandidateRecord) -> Path:
    recorded = [t.candidate_path for t in rec.by_generation.values() if t.candidate_path]
    for p in recorded:
        if Path(p).is_file():
            return Path(p)
    return run.candidates_dir / f"{rec.candidate_hash}.py"


def _source(run: RunFolder, rec: CandidateRecord) -> tuple[str | None, str]:
    path = _path(run, rec)
    try:
        source = path.read_text()
    except OSError as e:
        return None, f"source not found: {path} ({e.strerror})"
    if hashlib.sha256(source.encode()).hexdigest()[:16] != rec.candidate_hash:
        return None, f"source changed: {path} no longer has the content that was tried"
    return source, ""


def _first_line(text: str) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def render(result: IntegrationResult, console_width: int | None = None):
    """The end-to-end table for the terminal (rich): per workload eager, tuned, speedup,
    baselines, and the error against the end-to-end tolerance; then what was kept and dropped."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text
    kind = "CPU timings, not GPU numbers" if result.timing_kind == "cpu" else f"GPU timings, {result.device_name}"
    names = [n for n in BASELINES if any(n in w.baselines for w in result.workloads)]
    table = Table(title=f"end to end ({kind})", title_justify="left")
    for col in ("workload", "eager ms", "tuned ms", "speedup", *[f"{n} ms" for n in names], "error / tolerance"):
        table.add_column(col, justify="left" if col in ("workload", "error / tolerance") else "right")
    for w in result.workloads:
        cells = [w.name, f"{w.eager_ms:.4f}", _ms(w.tuned_ms), f"{w.speedup:.2f}x" if w.speedup else "-"]
        for n in names:
            ms, sp = w.baselines.get(n), w.baseline_speedups.get(n)
            cells.append("failed" if ms is None else f"{ms:.4f} ({sp:.2f}x)" if sp else f"{ms:.4f}")
        cells.append(f"{w.error:.3g} / {w.tolerance}" if w.error is not None else f"- / {w.tolerance}")
        table.add_row(*cells)
    lines = [table]
    if result.speedup:
        lines.append(Text(f"weighted end-to-end speedup {result.speedup:.2f}x"
                          + (" (CPU timing)" if result.timing_kind == "cpu" else "")))
    for a in result.accepted:
        lines.append(Text(f"applied {a.region}: {a.candidate_hash} ({a.template or a.planner}, region "
                          f"{a.region_speedup:.2f}x, {a.instances} instance{'s' * (a.instances != 1)})"))
    for d in result.dropped:
        lines.append(Text(f"dropped {d.region} {d.candidate_hash}: {d.reason}"))
    for name, text in result.baseline_errors.items():
        lines.append(Text(f"baseline {name} failed: {_first_line(text)}"))
    for n in result.notes:
        lines.append(Text(f"note: {n}"))
    return Group(*lines)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def summary(result: IntegrationResult) -> dict:
    """What `agent tune --json` prints about integration."""
    return {"speedup": result.speedup, "timing_kind": result.timing_kind,
            "accepted": [a.region for a in result.accepted],
            "dropped": [{"region": d.region, "candidate": d.candidate_hash, "reason": d.reason}
                        for d in result.dropped],
            "workloads": [w.model_dump() for w in result.workloads]}
