"""Integration's decisions, made in the tuner on what the sandbox sent back.

- the order regions are tried in: by expected gain for the whole model,
  share_of_model x (1 - 1/speedup), so the region that saves the most time goes first;
- whether a tuned model stays within the end-to-end tolerance on every workload, against
  the frozen model outputs (`runs/<run>/model/`, see tools.capture.freeze_model). Errors
  compound across layers, so a candidate within its region's tolerance can still fail here.

The orchestration that needs the sandbox and the run's history is agent/integrate.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tools.capture import ModelReference
from tools.verify import check_structure, diff


def expected_gain(share: float, speedup: float | None) -> float:
    """Fraction of the model's time a region's winner saves: share x (1 - 1/speedup)."""
    if not speedup or speedup <= 0 or not math.isfinite(speedup):
        return -math.inf
    return share * (1.0 - 1.0 / speedup)


@dataclass
class E2ECheck:
    ok: bool
    reason: str = ""
    errors: dict[str, float] = field(default_factory=dict)
    """Per workload: the number compared with that workload's tolerance (worst of the two runs)."""
    calls: list[dict[str, int]] = field(default_factory=list)
    """Per workload: calls routed through each candidate in one forward pass."""


def untouched_drift(ref: ModelReference, frozen: list[dict], untouched: list[list]) -> str | None:
    """Why the untouched model, rebuilt from its frozen state in the sandbox, cannot serve as the
    baseline (it does not reproduce the frozen outputs), or None when it does."""
    for w, f, u in zip(ref.workloads, frozen, untouched):
        d = diff(u, f["outputs"])
        err = d.error(w.tolerance)
        if d.bad_nonfinite or len(u) != len(f["outputs"]) or not err <= w.tolerance.value:
            return (f"the untouched model rebuilt from its frozen state differs from the frozen outputs on "
                    f"{w.name} by {err:.3g} (tolerance {w.tolerance}): it depends on state outside the "
                    "model (randomness, globals) or runs on another device than the freeze")
    return None


def judge(ref: ModelReference, frozen: list[dict], input_hashes: list[str], header: dict, runs: dict,
          device_type: str) -> E2ECheck:
    """The tuned model's verdict from the worker's report and its outputs (two runs per workload)."""
    n = len(frozen)
    calls = header.get("calls", [])
    for i, (w, f) in enumerate(zip(ref.workloads, frozen)):
        bad = check_structure(header["meta"][i], f, device_type)
        if bad:
            return E2ECheck(False, f"shape: {bad} on {w.name}", calls=calls)
    if header.get("params_changed"):
        return E2ECheck(False, "mutated_input: changed module tensors "
                        + ", ".join(header["params_changed"][:5]), calls=calls)
    changed = [ref.workloads[i % n].name for i, h in enumerate(header["input_hashes"]) if h != input_hashes[i % n]]
    if changed:
        return E2ECheck(False, f"mutated_input: the model's inputs changed during the call ({changed[0]})", calls=calls)
    if header.get("tampered"):
        return E2ECheck(False, "suspicious: torch or harness functions were replaced: "
                        + ", ".join(header["tampered"][:5]), calls=calls)
    errors: dict[str, float] = {}
    for i, (w, f) in enumerate(zip(ref.workloads, frozen)):
        tol = w.tolerance
        a, b = diff(runs["a"][i], f["outputs"]), diff(runs["b"][i], f["outputs"])
        if a.bad_nonfinite and not b.bad_nonfinite:
            return E2ECheck(False, f"uninitialized: {a.bad_nonfinite} output values on {w.name} keep the poison "
                            "put into fresh memory", errors, calls)
        if a.bad_nonfinite:
            return E2ECheck(False, f"nan: {a.bad_nonfinite} outputs on {w.name} are NaN/inf where the frozen "
                            "outputs are finite", errors, calls)
        if b.bad_nonfinite:
            return E2ECheck(False, f"nondeterministic: NaN/inf in the second run only on {w.name}", errors, calls)
        errors[w.name] = max(a.error(tol), b.error(tol))
        ab = diff(runs["a"][i], runs["b"][i])
        if tol.error(ab.max_abs, a.ref_max) > tol.value:
            return E2ECheck(False, f"nondeterministic: two runs differ by {ab.max_abs:.3g} on {w.name} "
                            f"(tolerance {tol})", errors, calls)
        if not errors[w.name] <= tol.value:
            return E2ECheck(False, f"end-to-end error {errors[w.name]:.3g} > tolerance {tol} on {w.name}",
                            errors, calls)
    return E2ECheck(True, "within the end-to-end tolerance on every workload", errors, calls)
