"""The parent's side of the `integrate` op: the whole model, with candidates routed in, run
and timed in a sandbox worker (sandbox/integrate_op.py). Candidate code never runs here.

Each new candidate set gets a fresh worker, so the untouched model's outputs and timings
come from a process no earlier candidate has touched. Replies are `sandbox.client.Reply`
values; nothing raises across the boundary, and the caller (agent/integrate.py) decides.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from sandbox.client import Reply, Worker, WorkerConfig


@dataclass
class IntegrateLimits:
    run_s: float = 900.0
    """Building the model, importing the candidates (Triton compiles) and both verification runs."""
    time_s: float = 600.0
    baseline_s: float = 1800.0
    """One torch.compile baseline: compiling (max-autotune takes long) and timing it."""
    budget_ms: float = 400.0
    max_reps: int = 200


class Integrator:
    def __init__(self, model_dir: Path, model_file: str, device: str = "cpu",
                 limits: IntegrateLimits | None = None, config: WorkerConfig | None = None):
        model_dir = Path(model_dir).resolve()  # the worker runs in a folder of its own
        self.base = {"op": "integrate", "model_file": str(Path(model_file).resolve()),
                     "state_path": str(model_dir / "state.pt"), "inputs_path": str(model_dir / "inputs.pt")}
        self.limits = limits or IntegrateLimits()
        self.worker = Worker(config or WorkerConfig(device=device))
        self.clean = True
        """The live worker (if any) has run no candidate code."""

    @property
    def hello(self) -> dict:
        return self.worker.hello

    def run(self, candidates: list[dict], output_bytes: list[list[int]] | None = None,
            untouched_outputs: bool = True, time_it: bool = False) -> Reply:
        """A fresh worker builds the untouched model (and returns its outputs), routes every
        instance of each candidate's class through it, runs the tuned model twice per workload,
        and times it against the untouched one when `time_it`. Candidates: {region_class,
        source, hash}."""
        self.worker.kill()
        self.clean = not candidates
        req = {**self.base, "candidates": candidates, "untouched_outputs": untouched_outputs, "run": True,
               "output_bytes": output_bytes, "time": time_it, "budget_ms": self.limits.budget_ms,
               "max_reps": self.limits.max_reps}
        t0 = time.monotonic()
        reply = self.worker.request(req, timeout=self.limits.run_s + (self.limits.time_s if time_it else 0))
        if reply.ok and time_it:
            return self._checked(reply, "timings", ("eager", "tuned"), t0)
        return reply

    def baseline(self, name: str) -> Reply:
        """torch.compile of the untouched model in one mode, timed against eager, in a worker that
        has run no candidate code (the baselines share one). A failure to compile or run comes
        back as text in `baseline_errors`, not as a failed reply."""
        if not self.clean:
            self.worker.kill()
            self.clean = True
        req = {**self.base, "candidates": [], "baselines": [name], "budget_ms": self.limits.budget_ms,
               "max_reps": self.limits.max_reps}
        t0 = time.monotonic()
        reply = self.worker.request(req, timeout=self.limits.baseline_s)
        if reply.ok and reply.header.get("spoiled"):
            self.worker.kill()
        if reply.ok and name in reply.header.get("baselines", {}):
            # No candidate code ran in this worker; torch.compile itself replaces functions the
            # tamper check watches (dynamo wraps Module.__init__), so that check does not apply.
            return self._checked(reply, None, ("eager", "compiled"), t0, tamper_check=False)
        return reply

    def _checked(self, reply: Reply, key: str | None, sides: tuple[str, str], t0: float,
                 tamper_check: bool = True) -> Reply:
        """Reported medians times repetitions cannot exceed the wall time of the request."""
        wall_ms = (time.monotonic() - t0) * 1e3
        if tamper_check and reply.header.get("tampered"):
            self.worker.kill()
            return Reply(False, reply.header, status="suspicious", error="torch or harness functions were "
                         "replaced during the run: " + ", ".join(reply.header["tampered"][:5]))
        rows = reply.header.get(key, []) if key else [
            t for b in reply.header.get("baselines", {}).values() for t in b["timings"]]
        claimed = sum(t[s]["median_ms"] * t[s]["reps"] for t in rows for s in sides)
        if claimed > 1.05 * wall_ms:
            self.worker.kill()
            return Reply(False, reply.header, status="suspicious", error=f"reported timings ({claimed:.0f} ms) "
                         f"exceed the wall time of the request ({wall_ms:.0f} ms): the worker is lying")
        return reply

    def close(self) -> None:
        self.worker.close()
