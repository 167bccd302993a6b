"""The tolerance gate: the parent's decision on a candidate's outputs.

Everything here runs in the tuner process on tensors the worker sent back. The worker only
reports; this module decides. Checks run in an order that gives the most specific reason:
structure, poison/NaN, mutated inputs, tampering, error against the reference, agreement
between two runs, and finally fresh random inputs against the original region.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch

from tools.problem import Problem, Tolerance
from tools.trial import Status


@dataclass
class Verdict:
    status: Status
    reason: str = ""
    max_abs: float | None = None
    max_rel: float | None = None
    error: float | None = None
    fresh_error: float | None = None
    flags: list[str] = field(default_factory=list)


@dataclass
class Diff:
    max_abs: float
    ref_max: float
    bad_nonfinite: int

    def error(self, tol: Tolerance) -> float:
        return tol.error(self.max_abs, self.ref_max)


def diff(out: list[torch.Tensor | None], ref: list[torch.Tensor | None]) -> Diff:
    """Worst absolute difference over all output tensors. Computed in float32 for 16-bit and
    32-bit outputs (a bf16 or fp16 difference is exact there) and float64 for float64."""
    max_abs, ref_max, bad = 0.0, 0.0, 0
    for o, r in zip(out, ref):
        if r is None or o is None or not r.numel():
            continue
        wide = torch.promote_types(torch.promote_types(o.dtype, r.dtype), torch.float32)
        r_, r_finite, r_max = _widened(r, wide)
        if r_finite:  # the common case: NaN or inf in `o` would surface in the max
            m = float(torch.sub(o if o.is_floating_point() else o.to(wide), r_).abs_().max())
            if math.isfinite(m):
                max_abs, ref_max = max(max_abs, m), max(ref_max, r_max)
                continue
        o_ = o.to(wide)
        finite_r, finite_o = torch.isfinite(r_), torch.isfinite(o_)
        bad += int((~finite_o & finite_r).sum())
        same_special = (~finite_r) & ((o_ == r_) | (torch.isnan(o_) & torch.isnan(r_)))
        d = torch.nan_to_num(torch.where(same_special, torch.zeros_like(o_), (o_ - r_).abs()), nan=math.inf)
        max_abs = max(max_abs, float(d.max()))
        ref_max = max(ref_max, float(r_[finite_r].abs().max()) if finite_r.any() else 0.0)
    return Diff(max_abs, ref_max, bad)


_widened_cache: dict[int, tuple[weakref.ref, torch.Tensor | None, bool, float]] = {}


def _widened(r: torch.Tensor, wide: torch.dtype) -> tuple[torch.Tensor, bool, float]:
    """`r` in the wide dtype, whether it is all finite, and its largest finite magnitude;
    remembered while `r` lives, since every candidate is compared with the same references."""
    hit = _widened_cache.get(id(r))
    if hit is not None and hit[0]() is r and (hit[1] if hit[1] is not None else r).dtype == wide:
        return (hit[1] if hit[1] is not None else r), hit[2], hit[3]
    r_ = r.to(wide)
    finite = torch.isfinite(r_)
    everywhere = bool(finite.all())
    r_max = float(r_.abs().max()) if everywhere else (float(r_[finite].abs().max()) if finite.any() else 0.0)
    key, cache = id(r), _widened_cache
    # Never a strong reference to `r` itself (already wide): the entry must not keep it alive.
    cache[key] = (weakref.ref(r, lambda _, k=key: cache.pop(k, None)), None if r_ is r else r_, everywhere, r_max)
    return r_, everywhere, r_max


def dense(shape: list[int], stride: list[int]) -> bool:
    """True when the tensor covers its memory exactly once (no overlap, no gaps, no broadcast)."""
    dims = sorted((st, sz) for sz, st in zip(shape, stride) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def check_structure(meta: dict, ref: dict, device_type: str) -> str | None:
    if meta["structure"] != ref["structure"]:
        return f"returns {meta['structure']}, the region returns {ref['structure']}"
    for i, (m, r) in enumerate(zip(meta["outputs"], ref["outputs"])):
        if r is None:
            continue
        if m.get("kind") != "tensor":
            return f"output {i} is a {m.get('kind')}, not a plain torch.Tensor"
        if list(m["shape"]) != list(r.shape):
            return f"output {i} has shape {tuple(m['shape'])}, expected {tuple(r.shape)}"
        if m["dtype"] != str(r.dtype).removeprefix("torch."):
            return f"output {i} has dtype {m['dtype']}, expected {str(r.dtype).removeprefix('torch.')}"
        if m["device"] != device_type:
            return f"output {i} is on {m['device']}, expected {device_type}"
        if not dense(m["shape"], m["stride"]):
            return f"output {i} has strides {m['stride']} that overlap or leave gaps"
    return None


def judge(problem: Problem, reference: list[dict], input_hashes: list[str], fresh_ref: list[list],
          fresh_input_hashes: list[str], report: dict, runs: dict, device_type: str) -> Verdict:
    """Decide a candidate's status from the worker's report and returned outputs."""
    tol = problem.tolerance
    for i, ref in enumerate(reference):
        bad = check_structure(report["meta"][i], ref, device_type)
        if bad:
            return Verdict(Status.shape, f"input set {i}: {bad}")
    if report["params_changed"]:
        return Verdict(Status.mutated_input, f"changed module tensors: {', '.join(report['params_changed'][:5])}")
    n = len(reference)
    changed = [i for i in range(n) if report["input_hashes"][i] != input_hashes[i]
               or report["input_hashes"][n + i] != input_hashes[i]]
    changed += [f"fresh {i}" for i, h in enumerate(report["fresh_input_hashes"]) if h != fresh_input_hashes[i]]
    if changed:
        return Verdict(Status.mutated_input, f"inputs changed by the call (input sets {changed})")
    if report["tampered"]:
        return Verdict(Status.suspicious, "the candidate replaced functions of torch or the harness: "
                       + ", ".join(report["tampered"][:5]))
    worst, worst_b = Diff(0, 0, 0), Diff(0, 0, 0)
    for i, ref in enumerate(reference):
        same = runs["b"][i] is runs["a"][i]  # the worker found the second run bit-identical
        a = diff(runs["a"][i], ref["outputs"])
        b = a if same else diff(runs["b"][i], ref["outputs"])
        if a.bad_nonfinite:
            if not b.bad_nonfinite:
                return Verdict(Status.uninitialized, f"input set {i}: {a.bad_nonfinite} output values keep the "
                               "poison put into fresh memory: they are never written")
            return Verdict(Status.nan, f"input set {i}: {a.bad_nonfinite} outputs are NaN/inf where the reference is finite")
        if b.bad_nonfinite:
            return Verdict(Status.nondeterministic, f"input set {i}: NaN/inf in the second run only")
        worst = max(worst, a, key=lambda d: d.error(tol))
        worst_b = max(worst_b, b, key=lambda d: d.error(tol))
        ab = Diff(0.0, 0.0, 0) if same else diff(runs["a"][i], runs["b"][i])
        if ab.max_abs > 0 and tol.error(ab.max_abs, a.ref_max) > tol.value:
            return Verdict(Status.nondeterministic, f"input set {i}: two runs differ by {ab.max_abs:.3g} "
                           f"(tolerance {tol})", *_numbers(a, tol))
    err = worst.error(tol)
    if err > tol.value or not math.isfinite(err):
        return Verdict(Status.wrong, f"error {err:.3g} > tolerance {tol}", *_numbers(worst, tol))
    if worst_b.error(tol) > tol.value:
        return Verdict(Status.nondeterministic, f"second run's error {worst_b.error(tol):.3g} > tolerance {tol}",
                       *_numbers(worst, tol))
    fresh_err = 0.0
    for i, fref in enumerate(fresh_ref):
        d = diff(runs["fresh"][i], fref)
        if d.bad_nonfinite or len(runs["fresh"][i]) != len(fref):
            fresh_err = math.inf
            break
        fresh_err = max(fresh_err, d.error(tol))
    if fresh_err > tol.value:
        return Verdict(Status.hardcoded, f"within tolerance on the frozen inputs but error {fresh_err:.3g} on "
                       "fresh random inputs: the answer does not come from the inputs",
                       *_numbers(worst, tol), fresh_error=fresh_err)
    return Verdict(Status.ok, "within tolerance", *_numbers(worst, tol), fresh_error=fresh_err)


def _numbers(d: Diff, tol: Tolerance) -> tuple[float, float, float]:
    return d.max_abs, (d.max_abs / d.ref_max if d.ref_max else 0.0), d.error(tol)
