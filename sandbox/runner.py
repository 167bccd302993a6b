"""One worker's trial runner: load, verify and time candidates in a sandbox worker.

The runner holds the frozen references (they never enter a worker) and decides. Per trial it
draws fresh seeds; the device's reference worker (sandbox/reference.py), which never runs
candidate code, answers with the original's outputs on the fresh inputs and with perturbed
parameters, and times the original. Every call returns a `Trial`; nothing raises across the
boundary, so a night of crashing candidates costs trials, not the run. The same path serves a
region and the whole model (region path ""; its candidate routes the model's classes through
their winners, see agent/review/integrate.py).
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox import timed
from sandbox.client import Reply, Worker, WorkerConfig
from sandbox.device_lock import HostQuiet, verifying
from sandbox.reference import ReferenceWorker, register
from sandbox.seeds import seed
from tools import verify
from tools.problem import Problem
from tools.screen import ScreenBar
from tools.trial import Candidate, Status, Trial, error_line


@dataclass
class Limits:
    compile_s: float = 180.0
    """Importing the candidate and its first call per input shape, where kernels compile."""
    run_s: float = 120.0
    """All verification runs together."""
    time_s: float = 300.0
    budget_ms: float = 400.0
    """Target time for timing one workload (baseline and candidate together, the harness's work
    around the calls included)."""
    max_reps: int = 200
    retime_above: float = 10.0
    """Speedups above this are timed again and flagged."""
    rounds: int = 3
    """Runs of the original and the candidate per workload, alternating (the A/A band needs 2+)."""


@dataclass
class _Preloaded:
    hash: str
    starts: int
    failed: "Trial | None"
    phases: dict
    members_before: "set[int] | None"
    seconds: float
    started_at: float


@dataclass
class LoadedProblem:
    problem: Problem
    folder: Path
    reference: list[dict]
    pre_inputs: list | None = None


REGISTER_PARTS = ("files", "import", "build")
"""What a problem's registration in a worker spent: loading its inputs and state, importing the
model file (once per file), building the region on the device."""
HELLO_PARTS = ("imports", "fork", "setup", "device", "triton")
"""What a worker's start spent before its hello: importing torch and the harness, isolating
itself, initialising the device, importing Triton."""

SEED_SETS = 2
"""Fresh-input and perturbation draws per problem and reference worker, used in turn: the
original's answers to each are computed once and kept (a draw costs the reference worker the
original's run on every input set; the answers never reach a candidate worker either way)."""
_seed_sets: "weakref.WeakKeyDictionary[ReferenceWorker, dict[str, list]]" = weakref.WeakKeyDictionary()


class TrialRunner:
    def __init__(self, device: str = "cpu", limits: Limits | None = None, config: WorkerConfig | None = None,
                 device_lock: "threading.Lock | None" = None, reference: ReferenceWorker | None = None,
                 host_quiet: HostQuiet | None = None):
        self.device = device
        if device == "cpu":
            _cap_judge_threads()
        # Held while this runner's workers verify or time, so a sibling worker on the same
        # device only compiles meanwhile and never disturbs a timing.
        self.device_lock = device_lock or contextlib.nullcontext()
        # Shared with the runners under the same lock: no judging in the tuner beside a timing.
        self.host_quiet = host_quiet or HostQuiet()
        self.limits = limits or Limits()
        self.config = config or WorkerConfig(device=device)
        self.worker = Worker(self.config)
        self.own_reference = reference is None
        self.reference = reference or ReferenceWorker(WorkerConfig(**{**self.config.__dict__}))
        self.problems: dict[str, LoadedProblem] = {}
        self.worker_starts_seen = -1
        self.phases: dict[str, float] = {}
        self.last_checksums: list[float] = []
        """The output checksums the candidate's last timed run reported (sandbox/timed.py sets them)."""
        self.doing: tuple[str, str, float] | None = None
        """(candidate, step, since when) while a trial runs: the progress line's 'now:'."""
        self._preloaded: _Preloaded | None = None
        self.verify_seeds: tuple[int, int] | None = None
        """Fresh-input and perturbation seeds to verify with (default: drawn per trial). Set for
        runners that verify several ways of running one model on one draw: the reference
        worker's answer is computed once."""
        self.siblings: list[TrialRunner] = [self]
        """Runners whose workers share this device (the executor sets one list for all of them):
        those under the same device lock are stopped while this one times (`quiet`)."""
        self.unregistered: dict[str, str] = {}
        """Problems this runner's worker could not set up, and why: their trials are lost."""

    # -- set-up ----------------------------------------------------------------------------
    def add_problem(self, folder: Path) -> LoadedProblem:
        folder = Path(folder).resolve()  # the worker runs in a folder of its own
        problem = Problem.load(folder)
        _, reference, _ = problem.load_tensors(folder, inputs=False, state=False)
        lp = LoadedProblem(problem, folder, reference)
        self.problems[problem.name] = lp
        self.reference.add(problem, folder, reference)
        self.config.hide = sorted(set(self.config.hide) | {str(folder.parent.parent)})
        self.config.model_files = sorted(set(self.config.model_files) | {problem.model_file})
        self.worker_starts_seen = -1  # the next trial registers every problem with a fresh worker
        return lp

    def _ensure_worker(self) -> Reply | None:
        """A live candidate worker that knows every problem; failures come back as a Reply."""
        if self.worker.alive and self.worker.starts == self.worker_starts_seen:
            return None
        started = self.worker.start()
        if not started.ok:
            return started
        self.phases["start.worker"] = started.seconds  # to its hello (a spare's: what was left of it)
        for part, s in (started.header.get("parts") or {}).items():  # the worker's own account
            if part in HELLO_PARTS and isinstance(s, (int, float)) and 0 <= s < 1e5:
                self.phases[f"start.worker.{part}"] = s
        self.unregistered, starts = {}, self.worker.starts
        t_reg = time.monotonic()  # of the start: the process and its hello, then every problem's inputs and region
        for name, lp in self.problems.items():
            reply = register(self.worker, lp.problem, lp.folder, self.limits.compile_s)
            for part, s in (reply.header.get("parts") or {}).items():  # the worker's own account
                if part in REGISTER_PARTS and isinstance(s, (int, float)) and 0 <= s < 1e5:
                    self.phases[f"start.register.{part}"] = self.phases.get(f"start.register.{part}", 0.0) + s
            if not reply.ok:
                if self.worker.alive and self.worker.starts == starts:
                    # that problem only (a module that cannot be rebuilt): its trials are lost, not every region's
                    self.unregistered[name] = (f"the worker could not set up problem {name}: "
                                               f"{reply.error or reply.header.get('error')}")
                    continue
                self.worker.kill()
                return Reply(False, status="crash", error=f"worker could not set up problem {name}: "
                             f"{reply.error or reply.header.get('error')}")
        self.worker_starts_seen = self.worker.starts
        self.phases["start.register"] = time.monotonic() - t_reg
        return None

    # -- one trial ---------------------------------------------------------------------------
    def step(self, what: str, candidate: Candidate | None = None) -> None:
        """Say what this runner does now (a long compile or timing is visible while it lasts)."""
        label = f"{candidate.region} {candidate.hash[:8]}" if candidate else (self.doing or ("", "", 0.0))[0]
        self.doing = (label, what, time.monotonic())

    def now(self) -> str | None:
        """'LlamaAttention a84ba2fd compiling 25 s', or None when no trial runs."""
        if (d := self.doing) is None:
            return None
        return f"{d[0]} {d[1]} {time.monotonic() - d[2]:.0f} s"

    def preload(self, candidate: Candidate) -> None:
        """Start the worker and load the candidate (import, first call per shape: its compile)
        now; `run` of the same candidate goes on from there. Several runners' preloads can
        overlap while none of them verifies or times, so nothing is timed beside a compile."""
        t0, started = time.monotonic(), time.time()
        self.phases, self.members_before = {}, None
        lp = self.problems.get(candidate.region)
        self.step("loading", candidate)
        failed = self._load(candidate, lp) if lp is not None else None
        self.doing = None
        self._preloaded = _Preloaded(candidate.hash, self.worker.starts, failed, dict(self.phases),
                                     self.members_before, time.monotonic() - t0, started)

    def run(self, candidate: Candidate, *, candidate_path: str = "", do_time: bool = True,
            screen: ScreenBar | None = None) -> Trial:
        """The candidate's trial. `screen`: its region's best so far, against which a verified
        candidate is screened before it is timed in full (tools/screen.py)."""
        pre, self._preloaded = self._preloaded, None
        if pre is not None and (pre.hash != candidate.hash or pre.starts != self.worker.starts
                                or (pre.failed is None and not self.worker.alive)):
            pre = None  # loaded into a worker that is gone, or another candidate: load again
        t0, started = time.monotonic(), pre.started_at if pre else time.time()
        self.phases = dict(pre.phases) if pre else {}
        self.members_before = pre.members_before if pre else None
        self.step("loading", candidate)
        try:
            trial = self._run(candidate, do_time, pre, screen)
            if trial.status is Status.ok and self.worker.alive:
                self.step("probing torch.compile")
                self._probe_compiled(trial)
        finally:
            self.doing = None
        lp = self.problems.get(candidate.region)
        if lp is not None and lp.problem.constant_output is not None and trial.status is Status.ok:
            trial.flags.append(f"the region's output is constant ({lp.problem.constant_output:g} everywhere on its "
                               "frozen inputs): skipping the work is correct here, not a faster kernel")
        before = self.members_before
        if self.worker.alive and before is not None and self.worker.members() - before:
            # Processes the candidate started (a compile pool, or a setsid grandchild meant to
            # outlive it) end with its trial: the worker goes, and a fresh one serves the next.
            self.worker.kill()
            trial.flags.append("the candidate left processes running: its worker was replaced")
        trial.started_at = started
        trial.candidate_path = candidate_path
        # Device seconds: its load and its own verification and timing, not the wait between.
        trial.gpu_seconds = time.monotonic() - t0 + (pre.seconds if pre else 0.0)
        trial.phases = dict(self.phases)
        trial.finished_at = time.time()
        return trial

    def _probe_compiled(self, trial: Trial) -> None:
        """A candidate that uses torch.compile says how it really ran (sandbox/compiled.py): a
        way that fell back to eager is flagged, never ranked under the compiler's name."""
        with verifying(self.device_lock):
            reply = self.worker.request({"op": "compiled"}, timeout=self.limits.run_s)
        if reply.ok and reply.header.get("dynamo"):
            trial.dynamo = reply.header["dynamo"]
            if why := trial.compile_fallback:
                trial.flags.append(f"torch.compile {why}")

    def trial_fields(self, c: Candidate, lp: LoadedProblem | None) -> dict[str, Any]:
        h = self.worker.hello or self.reference.hello
        return dict(region=c.region, candidate_hash=c.hash, planner=c.planner, template=c.template,
                    params=c.params, device=self.device, device_name=h.get("device_name", ""),
                    generation=h.get("generation", ""), tolerance=str(lp.problem.tolerance) if lp else "",
                    versions={"torch": h.get("torch", ""), "triton": h.get("triton", "")},
                    jail=str(self.worker.isolation.get("kind", "")))

    def failed(self, c: Candidate, lp: LoadedProblem | None, reply: Reply, **extra: Any) -> Trial:
        status = Status(reply.status) if reply.status in Status._value2member_map_ else Status.crash
        if status is Status.oom:  # what it allocated may still be held by its module: a fresh worker next
            self.worker.kill()
        tampered = self._tampered_after_failure() if status not in (Status.crash, Status.lost, Status.oom) else []
        if tampered:  # the failure came with tampering: that is the verdict, and the worker goes
            return self.suspicious(c, lp, "the candidate replaced functions of torch or the harness (and then "
                                    f"failed: {error_line(reply.error)}): " + ", ".join(tampered[:5]),
                                    error_text=reply.error[-4000:], **extra)
        return Trial(**self.trial_fields(c, lp), status=status, reason=error_line(reply.error),
                     error_text=reply.error[-4000:], **extra)

    def _tampered_after_failure(self) -> list[str]:
        """A candidate that failed may still have patched the process: ask, and replace a worker
        that is tampered or does not answer, so the next candidate gets a clean one."""
        if not self.worker.alive:
            return []
        reply = self.worker.request({"op": "integrity"}, timeout=self.limits.run_s)
        if not reply.ok:
            self.worker.kill()
            return []
        return list(reply.header.get("tampered") or [])

    def _run(self, c: Candidate, do_time: bool, pre: "_Preloaded | None" = None,
             screen: ScreenBar | None = None) -> Trial:
        lp = self.problems.get(c.region)
        if lp is None:
            return Trial(**self.trial_fields(c, None), status=Status.compile_error,
                         reason=f"no problem named {c.region!r} in this run")
        failed = pre.failed if pre is not None else self._load(c, lp)
        if failed is not None:
            return failed
        reg = self.reference.problems[c.region]
        verdict, failed = self._verify(c, lp, reg)
        if failed is not None:
            return failed
        numbers = dict(max_abs=verdict.max_abs, max_rel=verdict.max_rel, error=verdict.error,
                       fresh_error=verdict.fresh_error,
                       workload_errors={w.name: e for w, e in zip(lp.problem.workloads, verdict.per_set)})
        if verdict.status is not Status.ok:
            if verdict.status is Status.suspicious:
                self.worker.kill()  # a tampered worker is not trusted with the next candidate
            return Trial(**self.trial_fields(c, lp), status=verdict.status, reason=verdict.reason, **numbers)
        if not do_time:
            return Trial(**self.trial_fields(c, lp), status=Status.ok, reason=verdict.reason, **numbers)
        return timed.time_trial(self, c, lp, numbers, screen)

    def _load(self, c: Candidate, lp: LoadedProblem) -> Trial | None:
        """Both workers up, the candidate imported and called once per shape; a failure as its Trial."""
        t_start = time.monotonic()
        if self.worker.alive and self.worker.starts == self.worker_starts_seen:
            bad = self.reference.ensure()
        else:  # both workers' starts (seconds of imports each) overlap
            self.step("starting its worker")
            started: list[Reply | None] = []
            pending = threading.Thread(target=lambda: started.append(self._ensure_worker()), daemon=True)
            pending.start()
            bad = self.reference.ensure()
            pending.join()
            bad = bad or (started[0] if started else Reply(False, status="crash", error="worker start failed"))
        if self.worker_starts_seen == self.worker.starts and time.monotonic() - t_start > 0.5:
            self.phases["start"] = time.monotonic() - t_start  # a worker (re)start, once per worker
        if bad is not None:
            return self.failed(c, lp, Reply(False, status="lost", error=bad.error))
        self.members_before = self.worker.members()
        if drift := self.reference.problems[c.region].drift or self.unregistered.get(c.region):
            return self.failed(c, lp, Reply(False, status="lost", error=drift))
        lim = self.limits
        self.step("importing and compiling")
        reply = self.worker.request({"op": "load", "problem": c.region, "source": c.source, "hash": c.hash},
                                    timeout=lim.compile_s)
        self.phases["load"] = reply.seconds
        if not reply.ok:
            return self.failed(c, lp, reply)
        if reply.header.get("tampered"):
            return self.suspicious(c, lp, "the candidate replaced functions of torch or the harness on import: "
                                    + ", ".join(reply.header["tampered"][:5]))
        return None

    def _verify(self, c: Candidate, lp: LoadedProblem, reg) -> tuple[verify.Verdict | None, Trial | None]:
        lim, p = self.limits, lp.problem
        n = len(lp.reference)
        s_fresh, s_perturb = self.verify_seeds or self._seed_set(c.region)
        fresh = [{"set": i, "seed": s_fresh + 7 * i} for i in range(n)]
        # Every set, not one: a candidate may take another path per shape (a decode GEMV below
        # some row count) and ignore a parameter only there.
        perturb = {"sets": list(range(n)), "seed": s_perturb}
        out_bytes = [[t.numel() * t.element_size() for t in ref["outputs"] if t is not None] for ref in lp.reference]
        t_wait = time.monotonic()
        self.step("waiting for the device")
        with verifying(self.device_lock, whole_model=p.is_whole_model):
            self.step("verifying")
            t_refs = time.monotonic()
            self.phases["lock_wait"] = self.phases.get("lock_wait", 0.0) + t_refs - t_wait
            refs = self.reference.refs(c.region, fresh, perturb, lim.run_s, keep=True)
            self.phases["refs"] = time.monotonic() - t_refs  # the original's answers (0 when kept)
            if not refs.ok:
                return None, self.failed(c, lp, Reply(False, status="lost", error="the reference worker failed: "
                                                     f"{refs.status}: {refs.error}"))
            reply = self.worker.request({"op": "verify", "output_bytes": out_bytes, "fresh": fresh, "perturb": perturb,
                                         "effects": reg.effects.get("mutates_inputs") or [False] * n},
                                        timeout=lim.run_s)
        self.phases["verify"] = reply.seconds
        if reply.ok:  # outside the lock: copying and sending outputs is CPU work
            reply = self.worker.request({"op": "verify_outputs"}, timeout=lim.run_s)
            self.phases["verify_outputs"] = reply.seconds
        if not reply.ok:
            return None, self.failed(c, lp, reply)
        runs = reply.tensors if isinstance(reply.tensors, dict) else {}
        for i in reply.header.get("b_same", []):  # bit-identical second runs were not sent again
            if isinstance(i, int) and 0 <= i < len(runs.get("b", [])) and runs["b"][i] is None:
                runs["b"][i] = runs["a"][i]
        if not _complete(runs, reply.header, n):
            return None, self.failed(c, lp, Reply(False, status="crash", error="the worker sent incomplete outputs"))
        ev = verify.Evidence(reference=lp.reference, effects=reg.effects, fresh=refs.tensors["fresh"],
                             fresh_sets=[f["set"] for f in fresh], perturbed=refs.tensors["perturbed"],
                             perturbed_sets=perturb["sets"], pre_inputs=_pre_inputs(lp, reg))
        t_judge = time.monotonic()
        with self.host_quiet.busy():
            verdict = verify.judge(p, ev, reply.header, runs, self.device.split(":")[0])
        self.phases["judge"] = time.monotonic() - t_judge
        return verdict, None

    def _seed_set(self, region: str) -> tuple[int, int]:
        """The next of the problem's `SEED_SETS` draws, shared by the runners of one reference worker."""
        sets = _seed_sets.setdefault(self.reference, {}).setdefault(region, [])
        if len(sets) < SEED_SETS:
            sets.append((seed(), seed()))
            return sets[-1]
        sets.append(sets.pop(0))
        return sets[-1]

    def suspicious(self, c: Candidate, lp: LoadedProblem, reason: str, **extra: Any) -> Trial:
        self.worker.kill()
        return Trial(**self.trial_fields(c, lp), status=Status.suspicious, reason=reason, **extra)

    @contextlib.contextmanager
    def quiet(self):
        """Every sibling's worker stopped while the block runs (this runner's own workers run).
        Only siblings that share this runner's device lock: ones that time beside it (CPU lanes
        without a lock) would stop each other's timings, each waiting for the other's end."""
        with contextlib.ExitStack() as stack:
            for other in self.siblings:
                if other is not self and other.device_lock is self.device_lock and other.worker.alive:
                    stack.enter_context(other.worker.frozen())
            yield

    def close(self) -> None:
        self.worker.close()
        if self.own_reference:
            self.reference.close()


def _cap_judge_threads() -> None:
    """With the CPU as the device, the tuner's comparisons take a quarter of its cores, at least
    one: the workers have the rest, and with two threads a comparison of 64M elements took six
    times as long as with one on a busy two-core host (OpenMP waits for a descheduled thread)."""
    import torch

    from tools.devices import host_cores
    torch.set_num_threads(max(1, min(torch.get_num_threads(), host_cores() // 4)))


def _pre_inputs(lp: LoadedProblem, reg) -> list | None:
    """The frozen inputs (memory-mapped), where the problem has declared in-place outputs the
    original writes: the verifier checks what it leaves untouched stays untouched."""
    if not lp.problem.inplace_inputs or not any(reg.effects.get("mutates_inputs") or []):
        return None
    if lp.pre_inputs is None:
        lp.pre_inputs = lp.problem.load_tensors(lp.folder, inputs=True, state=False)[0]
    return lp.pre_inputs


def _complete(runs: dict, header: dict, n: int) -> bool:
    if not all(isinstance(runs.get(k), list) for k in ("a", "b", "fresh", "perturbed")):
        return False
    if len(runs["a"]) != n or len(runs["b"]) != n or not isinstance(header.get("meta"), dict):
        return False
    return all(isinstance(r, list) for k in ("a", "b", "fresh", "perturbed") for r in runs[k])
