"""The reference worker of one device: a sandbox worker that never runs candidate code.

Every trial on the device asks it for what must not come from the candidate's process: the
original region's outputs on the trial's fresh inputs and with its perturbed parameters,
timed runs of the original (the baseline), and empty runs that measure the harness's own cost
(the tuner subtracts them from a candidate's wall time). Runners of sibling workers share it;
requests are serialised by its lock. If it dies it is restarted and its problems registered
again: nothing in it depends on a candidate.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox.client import Reply, Worker, WorkerConfig
from tools.problem import INPUTS_FILE, STATE_FILE, Problem
from tools.verify import diff


@dataclass
class Registered:
    problem: Problem
    folder: Path
    effects: dict = field(default_factory=dict)
    """`mutates_inputs`, `aliases` (see sandbox/reference_runs.py) and `post_inputs`."""
    drift: str = ""
    """Why the rebuilt original does not reproduce the frozen outputs ('' when it does)."""


class ReferenceWorker:
    def __init__(self, config: WorkerConfig, start_timeout: float = 180.0):
        self.config = WorkerConfig(**{**config.__dict__, "role": "reference"})
        self.worker = Worker(self.config)
        self.lock = threading.RLock()
        self.problems: dict[str, Registered] = {}
        self.reference: dict[str, list[dict]] = {}
        self.kept: dict[str, Reply] = {}
        self.registered_start = -1
        self.start_timeout = start_timeout

    def add(self, problem: Problem, folder: Path, reference: list[dict]) -> None:
        with self.lock:
            if problem.name not in self.problems:
                self.problems[problem.name] = Registered(problem, Path(folder))
                self.reference[problem.name] = reference
                self.registered_start = -1
                self.config.hide = sorted(set(self.config.hide) | {str(Path(folder).resolve().parent.parent)})
                self.config.model_files = sorted(set(self.config.model_files) | {problem.model_file})

    def ensure(self) -> Reply | None:
        """A live reference worker that knows every problem; a failure comes back as a Reply."""
        with self.lock:
            if self.worker.alive and self.worker.starts == self.registered_start:
                return None
            started = self.worker.start()
            if not started.ok:
                return started
            started_at = self.worker.starts
            for name, reg in self.problems.items():
                reply = register(self.worker, reg.problem, reg.folder, self.start_timeout)
                if not reply.ok:
                    why = f"the reference worker could not set up {name}: {reply.error or reply.header.get('error')}"
                    if self.worker.alive and self.worker.starts == started_at:  # that problem only: its trials lost
                        reg.drift = why
                        continue
                    self.worker.kill()
                    return Reply(False, status="crash", error=why)
                reg.effects = {**reply.header.get("effects", {}),
                               "post_inputs": (reply.tensors or {}).get("post_inputs")}
                reg.drift = _drift(reg.problem, self.reference[name], (reply.tensors or {}).get("outputs") or [])
            self.registered_start = self.worker.starts
            return None

    def refs(self, problem: str, fresh: list[dict], perturb: dict, timeout: float, keep: bool = False) -> Reply:
        """The original's outputs on fresh input sets and with perturbed parameters. `keep`: the
        answer is kept for the next runner that asks for the same seeds (integration verifies
        each way of running the model, each in a worker of its own, on one draw)."""
        key = json.dumps([problem, fresh, perturb], sort_keys=True)
        with self.lock:
            if key in self.kept:
                return self.kept[key]
            reply = self.request({"op": "refs", "problem": problem, "fresh": fresh, "perturb": perturb}, timeout)
            if keep and reply.ok:
                self.kept[key] = reply
            return reply

    def request(self, header: dict, timeout: float) -> Reply:
        with self.lock:
            bad = self.ensure()
            if bad is not None:
                return bad
            return self.worker.request(header, timeout=timeout)

    @property
    def hello(self) -> dict:
        return self.worker.hello

    def close(self) -> None:
        self.worker.close()


def register(worker: Worker, problem: Problem, folder: Path, timeout: float) -> Reply:
    """Register one problem with a worker: its inputs, state and model file go as open files (the
    jail shows none of their folders but the model's, and that one read-only)."""
    files = [open(Path(folder) / INPUTS_FILE, "rb"), open(Path(folder) / STATE_FILE, "rb"),
             open(problem.model_file, "rb")]
    try:
        return worker.request({"op": "problem", "name": problem.name, "model_file": problem.model_file,
                               "region_path": problem.region_path, "env": problem.model_env,
                               "meta": problem.build_on_meta, "seeded": problem.seeded_calls,
                               "fixed_ints": problem.fixed_ints},
                              timeout=timeout, fds=[f.fileno() for f in files])
    finally:
        for f in files:
            f.close()


def _drift(problem: Problem, reference: list[dict], outputs: list[Any]) -> str:
    for i, (ref, out) in enumerate(zip(reference, outputs)):
        tol = problem.tolerance_for(i)
        d = diff(out, ref["outputs"]) if out is not None and len(out) == len(ref["outputs"]) else None
        if d is None or d.bad_nonfinite or d.error(tol) > tol.value:
            err = "?" if d is None else f"{d.error(tol):.3g}"
            return (f"the original region rebuilt in the sandbox differs from the frozen outputs on input set {i} "
                    f"(error {err}, tolerance {tol}): it depends on state outside the region (randomness, "
                    "globals, environment) or runs on another device than the freeze")
    if len(outputs) != len(reference):
        return "the original region rebuilt in the sandbox did not run on every input set"
    return ""
