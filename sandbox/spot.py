"""Spot checks of timed repetitions (sandbox/timed.py draws which): the output a candidate's
worker kept for one repetition, against the original's answer on the same inputs and against the
checksum its run reported. What the check fetches, under the device lock; what it compares, after.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

from tools import timing, verify

if TYPE_CHECKING:
    from sandbox.client import Reply
    from tools.problem import Problem


class Loaded(Protocol):
    """A problem as its runner loaded it (sandbox/runner.py's LoadedProblem is one)."""
    problem: Problem
    reference: list[dict]
    """Per input set, the frozen original's outputs (they never enter a worker)."""


class CheckingRunner(Protocol):
    """What a spot check needs of the runner whose trial it checks (sandbox/runner.py's
    TrialRunner is one; timing's needs, sandbox/timed.py's TimingRunner, include these)."""
    limits: Any
    worker: Any
    """The candidate's worker."""
    reference: Any
    """The device's reference worker, which never runs candidate code."""
    device: str
    phases: dict[str, float]
    """The trial's seconds by phase."""
    last_checksums: list[float]
    """The output checksums the candidate's last timed run reported (sandbox/timed.py sets them)."""


class Refused(Exception):
    """A timing a check refused: the trial's status (`kind`) and why; `reply`, a worker's failure;
    `error`, the error beyond the tolerance where that is what refused it."""

    def __init__(self, trial_kind: str, reason: str, reply: "Reply | None" = None, error: float | None = None):
        super().__init__(reason)
        self.kind, self.reason, self.reply, self.error = trial_kind, reason, reply, error


def elements(lp: Loaded, i: int) -> int:
    return max(1, sum(t.numel() for t in lp.reference[i]["outputs"] if t is not None))


def _abs_sum(leaves: list) -> float:
    return float(sum(timing.finite_abs(t).double().sum() for t in leaves if t is not None and t.numel()))


def check(r: CheckingRunner, lp: Loaded, i: int, s: int, j: int,
          sums: list[float] | None = None) -> Callable[[], None]:
    """Repetition `j` of the last candidate run (drawn before it, never told to its worker)
    against the original's answer, kept by the reference worker from its run on the same inputs,
    and against the checksum the run committed to when it replied (`sums`, else the runner's
    last). The candidate's output is fetched now, before its worker runs another batch (under the
    device lock, but for a region's last round: sandbox/timed.py); the original's (trusted, kept
    by seed) and the comparison that raises `Refused` come once the lock is let go."""
    lim, p = r.limits, lp.problem
    kept = r.worker.request({"op": "kept", "indices": [j]}, timeout=lim.run_s)
    if not kept.ok:
        raise Refused("crash", kept.error, kept)
    got = ((kept.tensors or {}).get("outputs") or [None])[0]
    meta = (kept.header.get("meta") or [None])[0]
    if got is None or not isinstance(meta, dict):
        raise Refused("wrong", f"timed repetition {j} on {p.workloads[i].name}: no output was kept for it")
    layouts = [] if p.is_whole_model else (r.reference.problems[p.name].effects or {}).get("row_major") or []
    bad = verify.check_structure(meta, lp.reference[i], r.device.split(":")[0], layouts[i] if i < len(layouts) else None)
    if bad:
        raise Refused("shape", f"timed repetition {j} on {p.workloads[i].name}: {bad}")
    claimed = (sums if sums is not None else getattr(r, "last_checksums", None) or [None] * (j + 1))[j]

    def run() -> None:
        t0 = time.monotonic()  # the reference worker is shared by every lane: its wait shows apart
        want = _answer(r, lp, i, s, j)
        r.phases["spot_answer"] = r.phases.get("spot_answer", 0.0) + time.monotonic() - t0
        compare(lp, i, j, s, got, want, claimed)
    return run


def _answer(r: CheckingRunner, lp: Loaded, i: int, s: int, j: int) -> list:
    """The original's output on repetition `j`'s inputs: the one the reference worker kept from
    its timed run, or (dropped there: another runner's timings on a lane without the lock came
    between) computed again on the same draw."""
    kept = r.reference.request({"op": "kept", "seed": s}, timeout=r.limits.run_s)
    if kept.ok and (got := ((kept.tensors or {}).get("outputs") or [None])[0]) is not None:
        return got
    want = r.reference.request({"op": "refs", "problem": lp.problem.name,
                                "fresh": [{"set": i, "seed": s + 1000003 * j}]}, timeout=r.limits.run_s)
    if not want.ok:
        raise Refused("lost", f"the reference worker failed: {want.error}", want)
    return want.tensors["fresh"][0]


def compare(lp: Loaded, i: int, j: int, s: int, got: Any, want: Any, claimed: float | None) -> None:
    p = lp.problem
    seen = float(timing.checksum(got, timing.checksum_period(elements(lp, i), s, "cpu")))
    # The slack for cancellation, a float64 pass over the outputs, is only summed when it is needed.
    if claimed is None or not (math.isclose(seen, claimed, rel_tol=1e-3, abs_tol=1e-3)
                               or math.isclose(seen, claimed, rel_tol=1e-3, abs_tol=1e-3 + 1e-5 * _abs_sum(got))):
        raise Refused("suspicious", f"timed repetition {j} on {p.workloads[i].name}: the output kept for it does not "
                      "match the checksum the timed run reported (the run's outputs were not what was timed)")
    err = verify.judge_outputs(p, i, got, want)
    tol = p.tolerance_for(i)
    if not err <= tol.value:
        raise Refused("wrong", f"timed repetition {j} on {p.workloads[i].name}: error {err:.3g} > tolerance {tol} "
                      "(it behaves differently when timed, or caches answers)", error=err)
