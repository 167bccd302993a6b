"""Candidates and trials: what was tried, and what happened when it ran on one device."""

from __future__ import annotations

import hashlib
import re
import time
from enum import Enum
from typing import Any

from pydantic import BaseModel, Field


def verdict(speedup: float | None, band: float | None) -> str:
    """`faster` beyond the noise band, `slower` beyond it, otherwise `no change`."""
    if speedup is None:
        return ""
    band = band or 0.0
    if speedup > 1 + band:
        return "faster"
    return "slower" if speedup < 1 / (1 + band) else "no change"


class Status(str, Enum):
    """Why a trial ended the way it did. Only `ok` is ever ranked."""

    ok = "ok"
    compile_error = "compile_error"  # the file does not import, has no forward, or a kernel fails to compile
    runtime_error = "runtime_error"  # forward raised a Python exception
    shape = "shape"  # wrong structure, shape, dtype, device or strides
    wrong = "wrong"  # outside the tolerance on the frozen inputs
    nan = "nan"  # NaN or inf where the reference is finite
    uninitialized = "uninitialized"  # output keeps the poison written into fresh memory
    mutated_input = "mutated_input"  # changed an input or a module parameter
    aliased = "aliased"  # an output shares memory with an input, a parameter or an earlier output
    nondeterministic = "nondeterministic"  # two runs on the same inputs disagree
    late_write = "late_write"  # an output changed after the call returned (a thread, another stream)
    hardcoded = "hardcoded"  # right on the frozen inputs, wrong on fresh ones (cached or shape-keyed answers)
    ignored_parameter = "ignored_parameter"  # right with the frozen parameters, wrong with perturbed ones
    suspicious = "suspicious"  # tampered with torch or the harness, impossible speed, timings the tuner's clock refutes
    screened = "screened"  # verified, then read clearly slower than the region's best in a short screen: never ranked
    timeout = "timeout"
    oom = "oom"
    crash = "crash"  # the worker died: segfault, illegal memory access, os._exit, ...
    lost = "lost"  # the worker was lost for reasons not the candidate's (retried once)

    @property
    def passed(self) -> bool:
        return self is Status.ok


class Candidate(BaseModel):
    """A proposed replacement forward for one region."""

    region: str
    source: str
    planner: str = "manual"
    template: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    parents: list[str] = Field(default_factory=list)
    note: str = ""

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()[:16]


class WorkloadTiming(BaseModel):
    """Side-by-side timing of the original region and a candidate on one workload."""

    workload: str
    baseline_ms: float
    candidate_ms: float
    baseline_spread: float
    """(p80 - p20) / median of the baseline's repetitions."""
    candidate_spread: float
    reps: int
    speedup: float
    candidate_hidden_ms: float = 0.0
    """Kept for old stores; work on other streams now shows in `parent_ms`."""
    timing_kind: str = "cuda"
    """`cuda` (CUDA events) or `cpu` (host clock; never a GPU number)."""
    noise_band: float = 0.0
    """Relative A/A band: how far the original timed against itself moved between runs."""
    parent_ms: float | None = None
    """The candidate's time per call as the tuner's own clock bounds it (wall time of its runs
    minus empty runs of the same shape): the claimed time may not be much below it."""
    baseline_runs: list[float] = Field(default_factory=list)
    """Median of each run of the original (the A/A samples behind `noise_band`)."""
    candidate_runs: list[float] = Field(default_factory=list)
    """Median of each run of the candidate, round by round beside `baseline_runs`."""
    controls: list[float] = Field(default_factory=list)
    """The original in the candidate's worker over the original in the reference worker, per
    control run (the cross-process part of `noise_band`)."""

    def band_parts(self) -> str:
        """What set the band (original, candidate, ratio, control: `tools.timing.band_parts`), for
        reading a wide band, not for deciding anything."""
        from tools.timing import band_parts
        if not self.candidate_runs:
            return "parts not recorded"  # a trial stored before they were
        parts = band_parts(self.baseline_runs, self.candidate_runs, self.controls, self.timing_kind)
        return ", ".join(f"{k} {v:.1%}" for k, v in parts.items())

    @property
    def verdict(self) -> str:
        """`faster`, `slower` or `no change` (inside the noise band)."""
        return verdict(self.speedup, self.noise_band)


class Trial(BaseModel):
    """One candidate on one device: the verdict, the error against the tolerance, the timing."""

    region: str
    candidate_hash: str
    candidate_path: str = ""
    planner: str = "manual"
    template: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    status: Status
    reason: str = ""
    error_text: str = ""
    max_abs: float | None = None
    max_rel: float | None = None
    error: float | None = None
    """The number compared with the tolerance: for a pass the worst over the frozen input sets; for
    a rejection the one that failed it (fresh inputs for `hardcoded`, perturbed parameters for
    `ignored_parameter`, a timed repetition or the two runs' difference where the reason says
    so); None where the verdict is not an error beyond the tolerance (`shape`, `suspicious`, ...).
    `max_abs` and `max_rel` belong to the same comparison."""
    tolerance: str = ""
    fresh_error: float | None = None
    """Same measure on fresh random inputs, against the original region run on them."""
    workload_errors: dict[str, float] = Field(default_factory=dict)
    """The error against the tolerance per workload (frozen input set)."""
    timings: list[WorkloadTiming] = Field(default_factory=list)
    speedup: float | None = None
    """Weighted over workloads: sum(w * baseline) / sum(w * candidate)."""
    noise_band: float | None = None
    """The weighted A/A noise band: a speedup within 1 +- this is `no change`, never a win."""
    flags: list[str] = Field(default_factory=list)
    screen: dict[str, Any] | None = None
    """What the screen read (tools/screen.py): the best it was compared with, how many times faster
    that best read, the margins; `audited` where it was timed in full anyway. Never a timing."""
    device: str = "cpu"
    device_name: str = ""
    generation: str = "cpu"
    gpu_seconds: float = 0.0
    """Wall time the trial held its device (start of load to verdict)."""
    dynamo: dict[str, Any] | None = None
    """For a candidate that runs torch.compile: dynamo's counters and the profiled calls'
    compiled regions and eager ops (sandbox/compiled.py); None when it never imported dynamo."""
    phases: dict[str, float] = Field(default_factory=dict)
    """Seconds per phase: load (import + first call, compiles kernels), verify, time."""
    versions: dict[str, str] = Field(default_factory=dict)
    jail: str = ""
    """What the candidate's worker ran in: `bubblewrap` (the jail) or `none` (--no-jail, or no jail
    on this machine: the candidate had the user's rights); empty when no worker ran it."""
    started_at: float = Field(default_factory=time.time)
    finished_at: float = 0.0

    @property
    def compile_fallback(self) -> str:
        """'' unless a compiled way ran eager, wholly or partly: then what ran eager."""
        return compile_fallback(self.dynamo)

    @property
    def ranked(self) -> bool:
        return self.status is Status.ok and self.speedup is not None

    @property
    def win(self) -> bool:
        """Passed and faster beyond the noise band (only such a trial is ever integrated or applied)."""
        return self.ranked and self.speedup > 1.0 + (self.noise_band or 0.0)


def compile_fallback(info: dict[str, Any] | None) -> str:
    """'' when every profiled call ran compiled code only; else what ran eager, in a few words."""
    if not info:
        return ""
    regions, eager = info.get("regions") or [], info.get("eager_ops") or []
    if regions and not any(regions) and eager and not any(eager):
        return ""  # no compiled region and no op run eager either: a CUDA graph's replay (integration's graphed way)
    if regions and not any(regions):
        return "fell back to eager: no compiled code ran"
    if any(r == 0 for r in regions):
        sets = [str(i) for i, r in enumerate(regions) if r == 0]
        return f"fell back to eager on input set{'s' * (len(sets) > 1)} {', '.join(sets)}"
    if any(eager) or info.get("graph_breaks"):
        return (f"partly eager: {info.get('graph_breaks', 0)} graph break(s), "
                f"up to {max(eager, default=0)} compute ops outside compiled code per call")
    return ""


_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure|Unsupported)\b")


def error_line(text: str) -> str:
    """The one line of a traceback that says what went wrong: the last exception's own line
    (an exception whose message runs on, as dynamo's do with advice on logging, keeps its
    first line), else the last line."""
    lines = [ln.rstrip() for ln in (text or "").strip().splitlines() if ln.strip()]
    heads = [ln for ln in lines if _EXC_LINE.match(ln)]
    return (heads[-1] if heads else lines[-1] if lines else "")[:300]
