"""Numbers and labels shared by the markdown and the HTML report, formatted one way."""

from __future__ import annotations

import math
import re

from tools.e2e import IntegrationResult
from tools.trial import verdict

_LONG_FLOAT = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d{4,}(?:[eE][-+]?\d+)?|\d+(?:\.\d+)?[eE][-+]?\d+)(?![\w.])")


def tidy(text: str) -> str:
    """Long floats in a message (`7.152557373046875e-07`) to three significant digits."""
    return _LONG_FLOAT.sub(lambda m: f"{float(m.group()):.3g}", text)


def within(error: float | None, tolerance: str) -> bool | None:
    """Whether an error is inside a tolerance written as `abs 0.01` / `rel:1e-3` / `0.01`."""
    parts = tolerance.replace(":", " ").split()
    try:
        bound = float(parts[-1])
    except (ValueError, IndexError):
        return None
    return None if error is None else (math.isfinite(error) and error <= bound)


def fmt_speedup(w) -> str:
    """A workload's end-to-end speedup with what it means against its A/A noise band."""
    if w.speedup is None:
        return "-"
    return f"{w.speedup:.2f}x ({w.verdict or verdict(w.speedup, w.noise_band)}, band ±{w.noise_band:.1%})"


def region_state(trials: int, passed: int, kept: int) -> str:
    """What a region's search came to, one sentence (the report and `agent status --json` say the
    same): a region nothing was tried on is not one where nothing passed."""
    if trials == 0:
        return "No trial ran on this region: nothing was tried on it, so nothing is known about it."
    if passed == 0:
        return f"No candidate passed the tolerance ({trials} tried)."
    if kept == 0:
        return f"No candidate passed on every target generation yet ({passed} of {trials} passed on some)."
    return f"{kept} candidate{'s' * (kept != 1)} kept ({passed} of {trials} passed)."


def cpu_headline(result: IntegrationResult) -> str:
    """A CPU run's end-to-end sentence: what was applied and whether it is right, never a speedup
    (a CPU timing says nothing about a GPU's)."""
    applied = ", ".join(a.region for a in result.accepted)
    what = (f"with {applied} applied the model" if applied else
            "nothing was applied (no candidate was faster beyond its noise band), so the model is the original and")
    outside = [w.name for w in result.workloads if within(w.error, w.tolerance) is False]
    right = (f"is OUTSIDE the tolerance on {', '.join(outside)}" if outside else
             "is within the tolerance on every workload")
    return f"{what} {right}. CPU timings say nothing about GPU speed: no speedup is claimed."


def standings(w) -> tuple[list[tuple[str, float | None]], str]:
    """Every way of running one workload (eager, nightshift, each torch.compile mode, each mode
    with our kernels inside) with its time, and one honest sentence on which is fastest: the
    best way with nightshift against the best without. Two ways closer than the wider of the
    workload's A/A noise band and each one's own (timed in a worker of its own) are a tie: the
    sentence never crowns noise."""
    rows = [("eager", w.eager_ms), ("nightshift", w.tuned_ms), *w.baselines.items()]
    timed = sorted((ms, name) for name, ms in rows if ms is not None and ms > 0)
    if not timed:
        return rows, "nothing was timed"
    ours = [(ms, n) for ms, n in timed if n.startswith("nightshift")]
    theirs = [(ms, n) for ms, n in timed if not n.startswith("nightshift")]
    band = max(0.0, w.noise_band or 0.0)
    if not ours:
        return rows, f"{timed[0][1]} is fastest ({timed[0][0]:.4g} ms); the tuned model was not timed"
    (best_ms, best), (rival_ms, rival) = ours[0], (theirs[0] if theirs else (None, None))
    if rival is None:
        return rows, f"{best} is fastest"
    own = getattr(w, "baseline_bands", None) or {}
    band = max([band, *(own.get(n) or 0.0 for n in (best, rival))])
    if abs(best_ms - rival_ms) <= min(best_ms, rival_ms) * band:
        return rows, f"{best} and {rival} tie within the noise band (±{band:.1%})"
    if best_ms < rival_ms:
        return rows, f"{best} is fastest, {rival_ms / best_ms:.2f}x ahead of {rival}"
    return rows, f"{rival} is fastest ({rival_ms:.4g} ms); {best} is {best_ms / rival_ms:.2f}x slower than it"


def weighted_totals(result: IntegrationResult) -> list[tuple[str, float | None]]:
    """Per way of running the model (eager, nightshift, each torch.compile mode): the sum over
    workloads of weight x time; None where a workload of weight > 0 was not timed that way.
    With `--workloads TRACE.jsonl` the weights are the trace's calls of each shape, so this is
    the device time the trace costs."""
    rows = [w for w in result.workloads if w.weight > 0]
    names = ["eager", "nightshift", *dict.fromkeys(n for w in rows for n in w.baselines)]
    out = []
    for name in names:
        times = [dict(standings(w)[0]).get(name) for w in rows]
        out.append((name, None if not rows or any(t is None for t in times) else
                    sum(w.weight * t for w, t in zip(rows, times))))
    return out


def fmt_ms(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.4g}"


def fmt_err(error: float | None, tolerance: str) -> str:
    verdict = {True: " (within)", False: " (OUTSIDE)", None: ""}[within(error, tolerance)]
    return f"{'-' if error is None else f'{error:.2g}'} / {tolerance or '?'}{verdict}"


def fmt_value(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(fmt_value(x) for x in v) + "]"
    return str(v)


def fmt_params(params: dict) -> str:
    """A candidate's parameters as `BLOCK_N=1024, num_warps=8`: the tuned values, and the
    binding of template roles to the region's tensors; never a raw dict or a whole source."""
    if not params:
        return ""
    tune = params.get("tune") if isinstance(params.get("tune"), dict) else {}
    binding = params.get("binding") if isinstance(params.get("binding"), dict) else {}
    plain = {k: v for k, v in params.items() if k not in ("tune", "binding", "tunables", "template_source")
             and isinstance(v, (int, float, str, bool)) and len(str(v)) <= 40}
    parts = [f"{k}={fmt_value(v)}" for k, v in {**tune, **plain}.items()]
    roles = [f"{k}←{fmt_value(v)}" for k, v in binding.items() if isinstance(v, str)]
    return "; ".join(x for x in (", ".join(parts), f"binding {', '.join(roles)}" if roles else "") if x)


def device_time(gpu_seconds: float, cpu_only: bool) -> str:
    h = gpu_seconds / 3600
    return f"{h:.4f} device-hours on the CPU" if cpu_only else f"{h:.4f} GPU-hours"


def times(x: float) -> str:
    """A speedup as read: two decimals, or two significant digits below 0.01x (a Triton kernel
    under the CPU interpreter reads 0.004x, never "0.00x")."""
    return f"{x:.2g}x" if 0 < x < 0.01 else f"{x:.2f}x"
