"""Candidates and trials: what was tried, and what happened when it ran on one device."""

from __future__ import annotations

import hashlib
import time
from enum import Enum
from typing import Any

from pydantic import BaseModel, Field


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
    nondeterministic = "nondeterministic"  # two runs on the same inputs disagree
    hardcoded = "hardcoded"  # right on the frozen inputs, wrong on fresh random ones
    suspicious = "suspicious"  # tampered with torch or the harness, impossible speed, hidden work
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
    """Median time the candidate's work kept running on other streams (already counted)."""
    timing_kind: str = "cuda"
    """`cuda` (CUDA events) or `cpu` (host clock; never a GPU number)."""


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
    """The number compared with the tolerance (worst over all frozen input sets)."""
    tolerance: str = ""
    fresh_error: float | None = None
    """Same measure on fresh random inputs, against the original region run on them."""
    timings: list[WorkloadTiming] = Field(default_factory=list)
    speedup: float | None = None
    """Weighted over workloads: sum(w * baseline) / sum(w * candidate)."""
    flags: list[str] = Field(default_factory=list)
    device: str = "cpu"
    device_name: str = ""
    generation: str = "cpu"
    gpu_seconds: float = 0.0
    """Wall time the trial held its device (start of load to verdict)."""
    phases: dict[str, float] = Field(default_factory=dict)
    """Seconds per phase: load (import + first call, compiles kernels), verify, time."""
    versions: dict[str, str] = Field(default_factory=dict)
    started_at: float = Field(default_factory=time.time)
    finished_at: float = 0.0

    @property
    def ranked(self) -> bool:
        return self.status is Status.ok and self.speedup is not None
