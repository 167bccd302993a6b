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

from tools import inplace
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
    per_set: list[float] = field(default_factory=list)
    """The error compared with the tolerance, per frozen input set (one per workload)."""


@dataclass
class Diff:
    max_abs: float
    ref_max: float
    bad_nonfinite: int

    def error(self, tol: Tolerance) -> float:
        return tol.error(self.max_abs, self.ref_max)


def diff(out: list[torch.Tensor | None] | None, ref: list[torch.Tensor | None]) -> Diff:
    """Worst absolute difference over all output tensors. Computed in float32 for 16-bit and
    32-bit outputs (a bf16 or fp16 difference is exact there), float64 for float64 and
    integers, complex128 for complex outputs (the modulus of the difference)."""
    max_abs, ref_max, bad = 0.0, 0.0, 0
    for o, r in zip(out, ref):
        if r is None or o is None or not r.numel():
            continue
        wide = torch.promote_types(torch.promote_types(o.dtype, r.dtype), torch.float32)
        if o.is_complex() or r.is_complex():
            wide = torch.complex128
        elif not (o.is_floating_point() and r.is_floating_point()):
            wide = torch.float64  # integers past 2**24 are not exact in float32
        if (fast := _blockwise(o, r, wide)) is not None:  # both finite everywhere: the common case
            max_abs, ref_max = max(max_abs, fast[0]), max(ref_max, fast[1])
            continue
        r_, r_finite, r_max = _widened(r, wide)
        if r_finite:  # NaN or inf in `o` would surface in the max
            delta = torch.sub(o if o.is_floating_point() else o.to(wide), r_)
            m = float((delta.abs() if delta.is_complex() else delta.abs_()).max())
            if math.isfinite(m):
                max_abs, ref_max = max(max_abs, m), max(ref_max, r_max)
                continue
        o_ = o.to(wide)
        finite_r, finite_o = torch.isfinite(r_), torch.isfinite(o_)
        bad += int((~finite_o & finite_r).sum())
        same_special = (~finite_r) & ((o_ == r_) | (torch.isnan(o_) & torch.isnan(r_)))
        gap = (o_ - r_).abs()
        d = torch.nan_to_num(torch.where(same_special, torch.zeros_like(gap), gap), nan=math.inf)
        max_abs = max(max_abs, float(d.max()))
        ref_max = max(ref_max, float(r_[finite_r].abs().max()) if finite_r.any() else 0.0)
    return Diff(max_abs, ref_max, bad)


BLOCK = 1 << 20
"""Elements compared per pass in `_blockwise`: a block's float32 temporaries stay in the CPU's
cache, where whole-tensor passes over a long prefill's outputs (67M elements) went to memory."""


def _blockwise(o: torch.Tensor, r: torch.Tensor, wide: torch.dtype) -> tuple[float, float] | None:
    """(max |o - r|, max |r|) over same-shaped real floating tensors, a block at a time; None
    where that does not apply or either holds a NaN or an infinity (the exact path sorts those)."""
    if (o.shape != r.shape or wide.is_complex or not (o.is_floating_point() and r.is_floating_point())
            or o.numel() <= BLOCK):
        return None
    of, rf = o.reshape(-1), r.reshape(-1)
    gaps, mags = [], []
    for j in range(0, of.numel(), BLOCK):
        rb = rf[j:j + BLOCK].to(wide)  # a view of `r` itself where it is already wide: never written
        gaps.append(torch.sub(of[j:j + BLOCK].to(wide), rb).abs_().amax())
        low, high = torch.aminmax(rb)
        mags.append(torch.maximum(-low, high))
    gap, mag = float(torch.stack(gaps).amax()), float(torch.stack(mags).amax())
    return (gap, mag) if math.isfinite(gap) and math.isfinite(mag) else None


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


def overlaps(shape: list[int], stride: list[int]) -> bool:
    """True when two indices of the tensor may share memory (a broadcast or an `as_strided`
    overlap); a slice of a larger buffer, which only leaves gaps, does not."""
    extent = 0
    for st, sz in sorted((abs(st), sz) for sz, st in zip(shape, stride) if sz > 1):
        if st <= extent:
            return True
        extent += (sz - 1) * st
    return False


def check_structure(meta: dict, ref: dict, device_type: str, row_major: list | None = None) -> str | None:
    """Why the outputs described by `meta` cannot stand for the region's (None if they can).
    `row_major`: per output, whether the original's own was dense row-major (reference worker)."""
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
        # An overlapping output (one row computed and expanded) is refused unless the region's
        # own output overlaps too; gaps are fine (transformers returns slices of its caches).
        if overlaps(m["shape"], m["stride"]) and not overlaps(list(r.shape), list(r.stride())):
            return f"output {i} has strides {m['stride']} whose elements overlap (the region's do not)"
        # The code around the region may view or reshape what it returns: where the region's output
        # is dense row-major, the candidate's must be too (right values in transposed strides made
        # the applied model's next .view() raise on every call).
        if row_major and i < len(row_major) and row_major[i] is True and not dense_row_major(m["shape"], m["stride"]):
            return (f"output {i} has strides {m['stride']}, where the region's own output is dense row-major: "
                    "the code that uses it may view it")
        if m.get("requires_grad"):
            return f"output {i} requires grad (the region's outputs do not)"
    return None


def dense_row_major(shape: list[int], stride: list[int]) -> bool:
    """What torch.Tensor.is_contiguous() says, from a shape and strides (size-1 dims ignored)."""
    expected = 1
    for size, st in reversed(list(zip(shape, stride))):
        if size == 0:
            return True
        if size != 1 and st != expected:
            return False
        expected *= size
    return True


@dataclass
class Evidence:
    """What the tuner holds to judge a candidate, none of it ever sent to a candidate worker."""

    reference: list[dict]
    """Frozen outputs per input set: {"structure", "outputs"}."""
    effects: dict = field(default_factory=dict)
    """From the reference worker: `mutates_inputs` (per set), `aliases` (per set, per output),
    `post_inputs` (the inputs after the original's call, where it changes them)."""
    fresh: list[list] = field(default_factory=list)
    """The original's outputs on the fresh input sets of this trial, in the order asked."""
    fresh_sets: list[int] = field(default_factory=list)
    perturbed: list[list] | None = None
    """The original's outputs with perturbed parameters on the frozen sets `perturbed_sets`, in order."""
    perturbed_sets: list[int] = field(default_factory=list)
    pre_inputs: list | None = None
    """The frozen input sets (the state before the call), where the problem declares in-place
    outputs: what the original leaves untouched there must stay untouched."""


def _alias_issue(meta: dict, original: list[dict] | None) -> str | None:
    for j, m in enumerate(meta["outputs"]):
        flags = m.get("aliases") or {}
        allowed = (original or [{}] * (j + 1))[j] if original and j < len(original) else {}
        for kind, what in (("input", "an input of the call"), ("param", "a parameter or buffer of the module"),
                           ("earlier", "the output of an earlier call")):
            if flags.get(kind) and not allowed.get(kind):
                return f"output {j} shares memory with {what}"
    return None


def judge(problem: Problem, ev: Evidence, report: dict, runs: dict, device_type: str) -> Verdict:
    """Decide a candidate's status from the worker's report, the outputs it returned, and the
    evidence this process holds (frozen references, the reference worker's answers)."""
    reference, effects = ev.reference, ev.effects or {}
    metas = report["meta"]
    # Region outputs feed the model's own code, which may view them; the whole model's go to its
    # caller, and torch.compile itself hands back other strides there (a causal LM's cache keys).
    layouts = [] if problem.is_whole_model else effects.get("row_major") or []

    def layout(i: int) -> list | None:
        return layouts[i] if i < len(layouts) else None
    for key, sets in (("a", range(len(reference))), ("b", range(len(reference)))):
        for i in sets:
            bad = check_structure(metas[key][i], reference[i], device_type, layout(i))
            if bad:
                return Verdict(Status.shape, f"input set {i}: {bad}")
    extra = [(f"fresh {ev.fresh_sets[k]}", m, reference[ev.fresh_sets[k]], ev.fresh_sets[k])
             for k, m in enumerate(metas.get("fresh", []))]
    extra += [(f"perturbed {ev.perturbed_sets[k]}", m, reference[ev.perturbed_sets[k]], ev.perturbed_sets[k])
              for k, m in enumerate(metas.get("perturbed", [])[:len(ev.perturbed_sets)])]
    for label, m, ref, i in extra:
        bad = check_structure(m, ref, device_type, layout(i))
        if bad:
            return Verdict(Status.shape, f"{label} inputs: {bad}")
    aliases = effects.get("aliases") or []
    for key in ("a", "b"):
        for i, m in enumerate(metas[key]):
            bad = _alias_issue(m, aliases[i] if i < len(aliases) else None)
            if bad:
                return Verdict(Status.aliased, f"input set {i}: {bad}")
    for label, m, _, _ in extra:
        bad = _alias_issue(m, aliases[0] if aliases else None)
        if bad:
            return Verdict(Status.aliased, f"{label} inputs: {bad}")
    if report["params_changed"]:
        return Verdict(Status.mutated_input, f"changed module tensors: {', '.join(report['params_changed'][:5])}")
    mutates = effects.get("mutates_inputs") or [False] * len(reference)
    mutated = report.get("mutated") or {}
    wrongly = [i for i in mutated.get("frozen", []) if not mutates[i]]
    wrongly += [f"fresh {i}" for i in mutated.get("fresh", []) if not mutates[i]]
    if wrongly:
        return Verdict(Status.mutated_input, f"inputs changed by the call (input sets {wrongly})")
    if report.get("late_writes"):
        return Verdict(Status.late_write, "outputs changed after the call returned (calls "
                       f"{', '.join(report['late_writes'][:3])}): written by a thread or a stream the call did not wait for")
    if report.get("tampered"):
        return Verdict(Status.suspicious, "the candidate replaced functions of torch or the harness: "
                       + ", ".join(report["tampered"][:5]))
    worst, worst_tol, worst_b = Diff(0, 0, 0), problem.tolerance, Diff(0, 0, 0)
    per_set: list[float] = []
    for i, ref in enumerate(reference):
        tol = problem.tolerance_for(i)
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
        ab = Diff(0.0, 0.0, 0) if same else diff(runs["a"][i], runs["b"][i])
        if ab.max_abs > 0 and tol.error(ab.max_abs, a.ref_max) > tol.value:
            return Verdict(Status.nondeterministic, f"input set {i}: two runs differ by {ab.max_abs:.3g} "
                           f"(tolerance {tol})", *_numbers(ab, tol))
        per_set.append(max(a.error(tol), b.error(tol)))
        if a.error(tol) / max(tol.value, 1e-300) > worst.error(worst_tol) / max(worst_tol.value, 1e-300):
            worst, worst_tol = a, tol
        if b.error(tol) > tol.value:
            worst_b = b
        if a.error(tol) > tol.value or not math.isfinite(a.error(tol)):
            return Verdict(Status.wrong, f"input set {i}: error {a.error(tol):.3g} > tolerance {tol}", *_numbers(a, tol))
        if mutates[i] and problem.inplace_inputs and effects.get("post_inputs") and runs.get("post_inputs"):
            bad = inplace.check(problem.inplace_inputs, runs["post_inputs"][i], effects["post_inputs"][i],
                                ev.pre_inputs[i] if ev.pre_inputs else None, tol, diff)
            if bad:
                return Verdict(bad[0], f"input set {i}: {bad[1]}", *(_numbers(bad[2], tol) if bad[2] else ()))
        elif mutates[i] and effects.get("post_inputs") and runs.get("post_inputs"):
            d = diff(_leaves(runs["post_inputs"][i]), _leaves(effects["post_inputs"][i]))
            if d.bad_nonfinite or d.error(tol) > tol.value:
                return Verdict(Status.wrong, f"input set {i}: what the call writes into its inputs differs from the "
                               f"original's by {d.error(tol):.3g} (tolerance {tol})", *_numbers(d, tol))
    if worst_b.error(worst_tol) > worst_tol.value:
        return Verdict(Status.nondeterministic, f"second run's error {worst_b.error(worst_tol):.3g} > tolerance "
                       f"{worst_tol}", *_numbers(worst_b, worst_tol))
    fresh_err = 0.0
    for k, fref in enumerate(ev.fresh):
        i = ev.fresh_sets[k]
        tol = problem.tolerance_for(i)
        got = runs["fresh"][k] if k < len(runs.get("fresh", [])) else None
        d = diff(got, fref) if got is not None and len(got) == len(fref) else None
        scaled = _scaled(tol, d.ref_max if d else 0.0, reference[i])
        err = math.inf if d is None or d.bad_nonfinite else d.error(scaled)
        fresh_err = max(fresh_err, err)
        if err > scaled.value:
            return Verdict(Status.hardcoded, f"within tolerance on the frozen inputs but error {err:.3g} > tolerance "
                           f"{_said(scaled, tol)} on fresh inputs drawn from input set {i}: the answer does not come "
                           "from the inputs", *_failed(d, scaled), fresh_error=err)
    got_all, want_all = runs.get("perturbed") or [], ev.perturbed or []
    for k, i in enumerate(ev.perturbed_sets if ev.perturbed is not None else []):
        tol, got, want = problem.tolerance_for(i), _at(got_all, k), _at(want_all, k)
        d = diff(got, want) if got is not None and want is not None and len(got) == len(want) else None
        scaled = _scaled(tol, d.ref_max if d else 0.0, reference[i])
        err = math.inf if d is None or d.bad_nonfinite else d.error(scaled)
        if err > scaled.value:
            return Verdict(Status.ignored_parameter, f"input set {i}: within tolerance with the frozen parameters but error {err:.3g} "
                           f"> tolerance {_said(scaled, tol)} with perturbed ones: the answer does not follow the "
                           "module's parameters (one is ignored, assumed to be 1 or 0, or kept from an earlier call: "
                           "they were changed in place, so key a derived copy on each tensor's _version)",
                           *_failed(d, scaled), fresh_error=fresh_err)
    return Verdict(Status.ok, "within tolerance", *_numbers(worst, worst_tol), fresh_error=fresh_err, per_set=per_set)


def _at(items: list, k: int):
    return items[k] if k < len(items) else None


def judge_outputs(problem: Problem, set_index: int, got: list | None, expected: list) -> float:
    """Error of one timed repetition's outputs against the original's on the same inputs."""
    tol = problem.tolerance_for(set_index)
    if got is None or len(got) != len(expected):
        return math.inf
    d = diff(got, expected)
    return math.inf if d.bad_nonfinite else d.error(tol)


def _scaled(tol: Tolerance, ref_max: float, frozen: dict) -> Tolerance:
    """An absolute tolerance scaled to outputs whose magnitude moved with fresh values or
    perturbed parameters (never tighter than as written)."""
    if tol.kind != "abs":
        return tol
    # The frozen outputs' magnitudes are remembered with their widened copies (`_widened`): every
    # trial scales by the same ones.
    widened = [_widened(t, torch.promote_types(t.dtype, torch.float32)) for t in frozen["outputs"]
               if isinstance(t, torch.Tensor) and t.numel() and t.is_floating_point()]
    frozen_max = max((r_max for _, finite, r_max in widened if finite), default=0.0)
    if frozen_max <= 0 or ref_max <= frozen_max:
        return tol
    return Tolerance(kind="abs", value=tol.value * ref_max / frozen_max)


def _leaves(x) -> list:
    out = []
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, dict):
        for v in x.values():
            out += _leaves(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            out += _leaves(v)
    return out


def _numbers(d: Diff, tol: Tolerance) -> tuple[float, float, float]:
    return d.max_abs, (d.max_abs / d.ref_max if d.ref_max else 0.0), d.error(tol)


def _said(scaled: Tolerance, tol: Tolerance) -> str:
    """A tolerance as a reason gives it: one scaled to larger outputs says so."""
    if scaled.value == tol.value:
        return str(tol)
    return f"{scaled.kind} {scaled.value:.3g} ({tol} scaled to these outputs' magnitude)"


def _failed(d: Diff | None, tol: Tolerance) -> tuple[float | None, float | None, float]:
    """The numbers of a comparison that failed: a rejection shows the error that rejected it
    (never the frozen inputs' 0.0 beside a fresh or perturbed failure)."""
    if d is None or d.bad_nonfinite:
        return None, None, math.inf
    return _numbers(d, tol)
