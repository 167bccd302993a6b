"""What integration found: the winners applied to the whole model, checked end to end.

Written to `runs/<run>/integration.json` by `agent.review.integrate`, read by the report and by
`agent apply`.
"""

from __future__ import annotations

import time
from pathlib import Path

from pydantic import BaseModel, Field

from tools import strict_json

INTEGRATION_FILE = "integration.json"
FAILED_FILE = "integration_failed.txt"
"""Why the last integration of a run gave no result (removed when one does): the report says it."""


def record_failure(run_path: Path, reason: str) -> None:
    path = Path(run_path) / FAILED_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(reason.strip() + "\n")
    tmp.replace(path)


def last_failure(run_path: Path) -> str | None:
    try:
        return (Path(run_path) / FAILED_FILE).read_text().strip() or None
    except OSError:
        return None


class AcceptedRegion(BaseModel):
    region: str
    """Problem name (the region's class)."""
    candidate_hash: str
    candidate_path: str
    planner: str = ""
    template: str | None = None
    region_speedup: float | None = None
    """The region's own speedup from the search (weighted over workloads)."""
    instances: int = 0
    """Module instances of the region's class routed through the candidate."""
    under_compile: list[str] | None = None
    """Input shapes (agent/dispatch.shape_key; "*": every call) where, inside torch.compile, the
    region's own code runs, compiled with the rest: torch.compile of the region was as fast as
    the candidate there. None: the candidate runs there as in the eager model."""


class DroppedCandidate(BaseModel):
    region: str
    candidate_hash: str
    reason: str
    """Why it was not kept end to end, e.g. 'end-to-end error 0.21 > tolerance abs 0.0625 on prefill'."""


class WorkloadResult(BaseModel):
    name: str
    weight: float = 1.0
    eager_ms: float
    """The untouched model, timed side by side with the tuned one in the same worker."""
    tuned_ms: float | None = None
    speedup: float | None = None
    error: float | None = None
    """End-to-end error of the tuned model against the frozen model outputs."""
    tolerance: str = ""
    noise_band: float = 0.0
    """Relative A/A band of the untouched model timed against itself (per workload)."""
    verdict: str = ""
    """`faster`, `slower` or `no change` (the speedup lies inside the noise band)."""
    baselines: dict[str, float | None] = Field(default_factory=dict)
    """Every other way of running the model -> ms (None: failed): each torch.compile mode, and
    each mode with our kernels inside (`nightshift + <mode>`)."""
    baseline_speedups: dict[str, float | None] = Field(default_factory=dict)
    """Each baseline's speedup over eager, timed side by side with eager in one worker."""
    baseline_bands: dict[str, float | None] = Field(default_factory=dict)
    """Each baseline's own A/A band in its worker: its times and speedup are as sure as this,
    which may be wider than the tuned model's `noise_band` (a noisy worker)."""
    floor_ms: float | None = None


class IntegrationResult(BaseModel):
    device: str
    device_name: str = ""
    generation: str = ""
    timing_kind: str = "cpu"
    accepted: list[AcceptedRegion] = Field(default_factory=list)
    dropped: list[DroppedCandidate] = Field(default_factory=list)
    workloads: list[WorkloadResult] = Field(default_factory=list)
    baseline_errors: dict[str, str] = Field(default_factory=dict)
    baseline_fallbacks: dict[str, str] = Field(default_factory=dict)
    """Compiled ways that ran eager, wholly or partly (their names say so too) -> what ran eager."""
    dynamo: dict[str, dict] = Field(default_factory=dict)
    """Per compiled way: dynamo's counters and the profiled calls (sandbox/compiled.py)."""
    notes: list[str] = Field(default_factory=list)
    """What the reader should know: baselines skipped on the CPU, regions with no kept candidate, ..."""
    noise_band: float | None = None
    """The weighted A/A band: a weighted speedup within 1 +- this is `no change`."""
    cuda_graph: bool = False
    """The timed tuned model is captured in a CUDA graph per workload shape (integration's last step)."""
    created_at: float = Field(default_factory=time.time)

    def save(self, run_path: Path) -> Path:
        path = Path(run_path) / INTEGRATION_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(strict_json.dumps(self, indent=2))
        tmp.replace(path)
        (Path(run_path) / FAILED_FILE).unlink(missing_ok=True)
        return path

    @property
    def speedup(self) -> float | None:
        """Weighted over workloads: sum(w * eager) / sum(w * tuned)."""
        rows = [w for w in self.workloads if w.tuned_ms]
        total = sum(w.weight for w in rows)
        if not rows or total <= 0:
            return None
        return sum(w.weight * w.eager_ms for w in rows) / sum(w.weight * w.tuned_ms for w in rows)

    @classmethod
    def load(cls, run_path: Path) -> "IntegrationResult | None":
        path = Path(run_path) / INTEGRATION_FILE
        return cls.model_validate_json(path.read_text()) if path.is_file() else None
