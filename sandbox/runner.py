"""One device's trial runner: load, verify, and time candidates in a sandbox worker.

The runner holds the frozen references (they never enter the worker) and, per worker
incarnation, fresh random inputs with the original region's outputs for them, computed by
that worker before any candidate code ran in it. Every call returns a `Trial`; nothing
raises across the boundary, so a night of crashing candidates costs trials, not the run.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sandbox.client import Reply, Worker, WorkerConfig
from tools import verify
from tools.problem import Problem, tensor_hash
from tools.trial import Candidate, Status, Trial, WorkloadTiming


@dataclass
class Limits:
    compile_s: float = 180.0
    """Importing the candidate and its first call, where Triton compiles its kernels."""
    run_s: float = 120.0
    """All verification runs together."""
    time_s: float = 300.0
    budget_ms: float = 400.0
    """Target wall time for timing one workload (baseline and candidate together)."""
    max_reps: int = 200
    retime_above: float = 10.0
    """Speedups above this are timed again and flagged."""


@dataclass
class LoadedProblem:
    problem: Problem
    folder: Path
    inputs: list[dict]
    reference: list[dict]
    input_hashes: list[str]


def fresh_inputs(inputs: list[dict], generator: torch.Generator) -> list[dict]:
    """Random inputs shaped like the frozen ones: floats drawn with the frozen mean and std,
    integers within the frozen range, booleans kept (masks have meaning)."""
    def draw(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if x.is_floating_point() and x.numel():
                xf = x.double()
                std = float(xf.std()) if x.numel() > 1 else 1.0
                r = torch.randn(x.shape, generator=generator, dtype=torch.float64)
                return (r * (std or 1.0) + float(xf.mean())).to(x.dtype)
            if x.dtype in (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8) and x.numel():
                lo, hi = int(x.min()), int(x.max())
                return torch.randint(lo, hi + 1, x.shape, generator=generator, dtype=x.dtype)
            return x.clone()
        if isinstance(x, (list, tuple)):
            return type(x)(draw(v) for v in x)
        if isinstance(x, dict):
            return {k: draw(v) for k, v in x.items()}
        return x
    return [draw(s) for s in inputs]


class TrialRunner:
    def __init__(self, device: str = "cpu", limits: Limits | None = None, config: WorkerConfig | None = None,
                 device_lock: "threading.Lock | None" = None):
        self.device = device
        # Held while this runner's worker verifies or times, so a sibling worker on the same
        # device only compiles meanwhile and never disturbs a timing.
        self.device_lock = device_lock or contextlib.nullcontext()
        self.limits = limits or Limits()
        self.worker = Worker(config or WorkerConfig(device=device))
        self.problems: dict[str, LoadedProblem] = {}
        self.fresh: dict[str, tuple[list[dict], list[list], list[str]]] = {}
        self.worker_starts_seen = -1
        self.phases: dict[str, float] = {}

    # -- set-up ----------------------------------------------------------------------------
    def add_problem(self, folder: Path) -> LoadedProblem:
        folder = Path(folder).resolve()  # the worker runs in a folder of its own
        problem = Problem.load(folder)
        inputs, reference, _ = problem.load_tensors(folder)
        lp = LoadedProblem(problem, folder, inputs, reference, [tensor_hash(s) for s in inputs])
        self.problems[problem.name] = lp
        self.worker_starts_seen = -1  # the next trial registers every problem with a fresh worker
        return lp

    def _ensure_worker(self) -> Reply | None:
        """A live worker that knows every problem; failures come back as a Reply."""
        if self.worker.alive and self.worker.starts == self.worker_starts_seen:
            return None
        started = self.worker.start()
        if not started.ok:
            return started
        for name, lp in self.problems.items():
            gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
            fresh = fresh_inputs(lp.inputs, gen)
            reply = self.worker.request(
                {"op": "problem", "name": name, "model_file": lp.problem.model_file,
                 "region_path": lp.problem.region_path, "state_path": str(lp.folder / "state.pt"),
                 "inputs_path": str(lp.folder / "inputs.pt")},
                {"fresh": fresh}, timeout=self.limits.compile_s)
            if not reply.ok:
                return Reply(False, status="crash", error=f"worker could not set up problem {name}: "
                             f"{reply.error or reply.header.get('error')}")
            self.fresh[name] = (fresh, reply.tensors["fresh_ref"], [tensor_hash(s) for s in fresh])
        self.worker_starts_seen = self.worker.starts
        return None

    # -- one trial ---------------------------------------------------------------------------
    def run(self, candidate: Candidate, *, candidate_path: str = "", do_time: bool = True) -> Trial:
        t0, started, self.phases = time.monotonic(), time.time(), {}
        trial = self._run(candidate, do_time)
        trial.started_at = started
        trial.candidate_path = candidate_path
        trial.gpu_seconds = time.monotonic() - t0
        trial.phases = dict(self.phases)
        trial.finished_at = time.time()
        return trial

    def _base(self, c: Candidate, lp: LoadedProblem | None) -> dict[str, Any]:
        h = self.worker.hello
        return dict(region=c.region, candidate_hash=c.hash, planner=c.planner, template=c.template,
                    params=c.params, device=self.device, device_name=h.get("device_name", ""),
                    generation=h.get("generation", ""), tolerance=str(lp.problem.tolerance) if lp else "",
                    versions={"torch": h.get("torch", ""), "triton": h.get("triton", "")})

    def _fail(self, c: Candidate, lp: LoadedProblem | None, reply: Reply, **extra: Any) -> Trial:
        status = Status(reply.status) if reply.status in Status._value2member_map_ else Status.crash
        return Trial(**self._base(c, lp), status=status, reason=_first_line(reply.error),
                     error_text=reply.error[-4000:], **extra)

    def _run(self, c: Candidate, do_time: bool) -> Trial:
        lp = self.problems.get(c.region)
        if lp is None:
            return Trial(**self._base(c, None), status=Status.compile_error,
                         reason=f"no problem named {c.region!r} in this run")
        t_start = time.monotonic()
        bad = self._ensure_worker()
        if self.worker_starts_seen == self.worker.starts and time.monotonic() - t_start > 0.5:
            self.phases["start"] = time.monotonic() - t_start  # a worker (re)start, once per worker
        if bad is not None:
            return self._fail(c, lp, Reply(False, status="lost", error=bad.error))
        lim = self.limits
        reply = self.worker.request({"op": "load", "problem": c.region, "source": c.source, "hash": c.hash},
                                    timeout=lim.compile_s)
        self.phases["load"] = reply.seconds
        if not reply.ok:
            return self._fail(c, lp, reply)
        out_bytes = [[t.numel() * t.element_size() for t in ref["outputs"] if t is not None] for ref in lp.reference]
        with self.device_lock:
            reply = self.worker.request({"op": "verify", "output_bytes": out_bytes}, timeout=lim.run_s)
        self.phases["verify"] = reply.seconds
        if reply.ok:  # outside the lock: hashing and sending outputs is CPU work
            reply = self.worker.request({"op": "verify_outputs"}, timeout=lim.run_s)
            self.phases["verify_outputs"] = reply.seconds
        if not reply.ok:
            return self._fail(c, lp, reply)
        runs = reply.tensors if isinstance(reply.tensors, dict) else {}
        for i in reply.header.get("b_same", []):  # bit-identical second runs were not sent again
            if isinstance(i, int) and 0 <= i < len(runs.get("b", [])) and runs["b"][i] is None:
                runs["b"][i] = runs["a"][i]
        if any(not isinstance(r, list) for key in ("a", "b", "fresh") for r in runs.get(key, [None])):
            return self._fail(c, lp, Reply(False, status="crash", error="the worker sent incomplete outputs"))
        fresh, fresh_ref, fresh_hashes = self.fresh[c.region]
        v = verify.judge(lp.problem, lp.reference, lp.input_hashes, fresh_ref, fresh_hashes,
                         reply.header, runs, self.device.split(":")[0])
        numbers = dict(max_abs=v.max_abs, max_rel=v.max_rel, error=v.error, fresh_error=v.fresh_error)
        if v.status is not Status.ok:
            if v.status is Status.suspicious:
                self.worker.kill()  # a tampered worker is not trusted with the next candidate
            return Trial(**self._base(c, lp), status=v.status, reason=v.reason, **numbers)
        if not do_time:
            return Trial(**self._base(c, lp), status=Status.ok, reason=v.reason, **numbers)
        return self._time(c, lp, numbers)

    def _time(self, c: Candidate, lp: LoadedProblem, numbers: dict) -> Trial:
        lim, flags = self.limits, []
        timings, reply = self._timing_request(lp, lim.budget_ms)
        if reply is not None:
            return self._fail(c, lp, reply, **numbers)
        speedup = _weighted_speedup(lp.problem, timings)
        floor_hit = [t.workload for t in timings if t.timing_kind == "cuda"
                     and t.candidate_ms < 0.9 * lp.problem.floor_ms.get(t.workload, 0.0)]
        if speedup > lim.retime_above or floor_hit:
            again, reply = self._timing_request(lp, 2 * lim.budget_ms)
            if reply is not None:
                return self._fail(c, lp, reply, **numbers)
            timings, speedup = again, _weighted_speedup(lp.problem, again)
            floor_hit = [t.workload for t in timings if t.timing_kind == "cuda"
                         and t.candidate_ms < 0.9 * lp.problem.floor_ms.get(t.workload, 0.0)]
            flags.append(f"speedup above {lim.retime_above:g}x: re-timed, {speedup:.2f}x")
        if floor_hit:
            return Trial(**self._base(c, lp), status=Status.suspicious, timings=timings, speedup=speedup,
                         reason=f"faster than the roofline floor on {floor_hit}: impossible, so not trusted",
                         flags=flags, **numbers)
        hidden = [t.workload for t in timings if t.candidate_hidden_ms > max(0.005, 0.1 * t.candidate_ms)]
        if hidden:
            flags.append(f"work on other streams counted in the time ({', '.join(hidden)})")
        return Trial(**self._base(c, lp), status=Status.ok, reason="within tolerance", timings=timings,
                     speedup=speedup, flags=flags, **numbers)

    def _timing_request(self, lp: LoadedProblem, budget_ms: float) -> tuple[list[WorkloadTiming], Reply | None]:
        with self.device_lock:
            t0 = time.monotonic()  # after the lock: waiting for a sibling is not this trial's timing
            reply = self.worker.request({"op": "time", "sets": list(range(len(lp.inputs))), "budget_ms": budget_ms,
                                         "max_reps": self.limits.max_reps}, timeout=self.limits.time_s)
        wall_ms = (time.monotonic() - t0) * 1e3
        self.phases["time"] = self.phases.get("time", 0.0) + wall_ms / 1e3
        if not reply.ok:
            return [], reply
        if reply.header.get("tampered"):
            self.worker.kill()
            return [], Reply(False, status="suspicious", error="the candidate replaced functions of torch or "
                             "the harness during timing: " + ", ".join(reply.header["tampered"][:5]))
        out, claimed_ms = [], 0.0
        for t, w in zip(reply.header["timings"], lp.problem.workloads):
            b, cnd = t["baseline"], t["candidate"]
            claimed_ms += b["median_ms"] * b["reps"] + cnd["median_ms"] * cnd["reps"]
            wt = WorkloadTiming(workload=w.name, baseline_ms=b["median_ms"], candidate_ms=cnd["median_ms"],
                                baseline_spread=b["spread"], candidate_spread=cnd["spread"], reps=cnd["reps"],
                                speedup=b["median_ms"] / max(cnd["median_ms"], 1e-9),
                                timing_kind=reply.header.get("timing_kind", "cpu"),
                                candidate_hidden_ms=cnd["hidden_ms"])
            out.append(wt)
        # Medians times repetitions cannot exceed the wall time the worker took to produce them.
        if claimed_ms > 1.05 * wall_ms:
            return [], Reply(False, status="suspicious", error=f"reported timings ({claimed_ms:.0f} ms) exceed "
                             f"the wall time of the request ({wall_ms:.0f} ms): the worker is lying")
        return out, None

    def close(self) -> None:
        self.worker.close()


def _weighted_speedup(problem: Problem, timings: list[WorkloadTiming]) -> float:
    w = problem.weights
    base = sum(w[t.workload] * t.baseline_ms for t in timings)
    cand = sum(w[t.workload] * t.candidate_ms for t in timings)
    return base / cand if cand > 0 else math.inf


def _first_line(text: str) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""
