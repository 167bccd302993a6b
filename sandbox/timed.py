"""Timing a verified candidate against the original, with nothing taken on the worker's word.

Per workload, under the device lock, with every sibling worker of the device stopped:

    warm-up: a few repetitions of each side (sizes the runs by what a repetition costs)
    for each round:
        the original, in the reference worker          -> its samples are trusted
        the candidate, in its worker, on the same fresh inputs; the tuner's own clock around it
        spot check, in a round drawn AFTER it ran (SPOT_CHANCE), and in the last round: one
            repetition, picked at random before the round and told to the reference worker only,
            its output, copied when it was timed, against the original's on the same inputs (kept
            by the reference worker from its run; the comparison itself runs after the workload,
            off the device lock, never beside a timing)
        the first round (every round for a whole model): the original in the candidate's
            worker, the A/A across the two processes

- Both runs do the same work around their calls, so the original's run, whose numbers are
  trusted, shows what that work costs, and the tuner's own clock bounds what the candidate's
  calls took (sandbox/timed_runs.py: a forged timer, patched statistics, a forged reply or work
  hidden on another stream all show there).
- With a screen (tools/screen.py) the first round of every workload comes first; a candidate
  clearly slower than its region's best there is not timed further.
- The noise band is A/A: how far runs of the same code move (the original's runs against each
  other, the candidate's, and the original run in the candidate's worker against the reference
  worker's), stored with the result: a speedup inside it is no change.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Generator, Protocol

from sandbox import timed_runs as runs
from sandbox.spot import CheckingRunner, Loaded, Refused, check as _spot_check, elements as _elements
from tools import timing
from tools.screen import ScreenBar, verdict
from tools.trial import Candidate, Status, Trial, WorkloadTiming

if TYPE_CHECKING:
    from sandbox.client import Reply


class TimingRunner(CheckingRunner, Protocol):
    """What timing needs of the runner whose trial it times (sandbox/runner.py's TrialRunner is
    one): besides a spot check's needs, the device's lock and quiet, and the trial's making."""
    device_lock: ContextManager
    host_quiet: Any
    """Shared by the runners under one device lock: no judging in the tuner beside a timing."""

    def step(self, what: str) -> None:
        """Say what the trial does now (the progress line's 'now:')."""

    def quiet(self) -> ContextManager:
        """Every sibling runner's worker stopped while the block runs."""

    def trial_fields(self, c: Candidate, lp: Loaded) -> dict[str, Any]:
        """The fields every trial of `c` on this runner carries (device, versions, jail...)."""

    def failed(self, c: Candidate, lp: Loaded, reply: "Reply", **extra: Any) -> Trial:
        """The trial of a worker's failure."""

    def suspicious(self, c: Candidate, lp: Loaded, reason: str, **extra: Any) -> Trial:
        """A suspicious trial (its worker is not trusted with another candidate)."""

WARMUP_REPS = {"cuda": 2, "cpu": 1}
"""Warm-up repetitions per side, by device. On the CPU nothing is cold by then (both sides ran the
call in verification, with nothing to upload), and a KernelBench softmax's second warm-up call and
its fresh inputs were a tenth of its trial."""
MIN_REPS = 2
"""Repetitions per round when one costs more than the budget allows (a slow call is timed by
the budget, as do_bench does, not by a count: three rounds of two still give the A/A band)."""
WHOLE_MODEL_MIN_REPS = 5
"""...but a whole model on a GPU gets at least this many: the end-to-end verdicts are the run's
headline, and two calls a round left the example's 35 ms long prefill with bands of ±8% on the
H100 (2026-12-06: a 4% lead over the compiler read as a tie), for about 1 s more a way."""
CLEARLY_SLOWER = 0.5
"""A region's workload whose first two rounds each read this speedup or less is timed in those
two (the fewest an A/A band is made of): more rounds would only narrow a band around a loss, and
a night's search tries many such candidates. The whole model is always timed in full."""
WIDE_BAND = 0.05
"""A whole model's workload on a GPU timed with an A/A band wider than this is timed once more
and the quieter of the two measurements kept (both sides are timed together in each, and the
choice looks at the band only, so it favours neither): on an H100 on 2026-12-06 integration's
bands read ±5-167% for minutes where the same ways read ±1-5% hours before, and a verdict inside
±25% says nothing. One more try costs a second or two a workload; the trial says it was re-timed."""
SPOT_CHANCE = 0.5
"""Each round of a workload but its last is spot-checked with this chance, drawn after the round
ran; the last round always is: a candidate cannot tell whether an earlier round is checked, and
one that turns on only after many calls is in its last round at the latest (one right for its
first 20 calls escaped once when the last round was checked only where no earlier one was: a few
repetitions a round, its honest first round drawn, no other).
A trial pays for half the earlier rounds' checks (on the H200 the checks were once most of a
full-size trial's timing: 4.4-5.2 s of 5.3-7.3 s)."""


def time_trial(r: TimingRunner, c: Candidate, lp: Loaded, numbers: dict,
               screen: ScreenBar | None = None) -> Trial:
    """`screen`: the region's best so far; a candidate clearly slower in the first round is
    `screened`, not timed further (tools/screen.py)."""
    lim, flags, retimed = r.limits, [], []
    try:
        timings, record = screened(r, lp, lim.budget_ms, screen) if screen else (
            measure(r, lp, lim.budget_ms, retimed), None)
        if record is not None and not record["audited"]:
            return Trial(**r.trial_fields(c, lp), status=Status.screened, screen=record, **numbers,
                         reason=f"verified; a short screen read it clearly slower than the region's best "
                                f"({record['best']}) on every workload: not timed further, never ranked")
        speedup = weighted_speedup(lp.problem, timings)
        floor_hit = _below_floor(lp, timings)
        if speedup > lim.retime_above or floor_hit:
            timings = measure(r, lp, 2 * lim.budget_ms, retimed)
            speedup, floor_hit = weighted_speedup(lp.problem, timings), _below_floor(lp, timings)
            flags.append(f"speedup above {lim.retime_above:g}x: re-timed, {speedup:.2f}x")
    except Refused as e:
        # Judged by what refused it: the frozen inputs' passing error is not a rejection's error.
        numbers = {**numbers, "max_abs": None, "max_rel": None, "error": e.error}
        if e.reply is not None:
            return r.failed(c, lp, e.reply, **numbers)
        if e.kind == "suspicious":
            return r.suspicious(c, lp, e.reason, **numbers)
        return Trial(**r.trial_fields(c, lp), status=Status(e.kind), reason=e.reason, **numbers)
    band = weighted_band(lp.problem, timings)
    if retimed:
        flags.append(f"timed again where its band was wider than ±{WIDE_BAND:.0%}, the quieter kept: "
                     + ", ".join(retimed))
    if short := [t.workload for t in timings if len(t.baseline_runs) < max(2, r.limits.rounds)]:
        flags.append(f"timed in two rounds on {', '.join(short)}: each read {CLEARLY_SLOWER:g}x of the original's "
                     "speed or less there")
    if (covered := r.phases.pop("host_bound", None)) is not None:
        flags.append(f"events unconfirmed: its CUDA events covered {covered:.0%} of what the tuner's clock saw "
                     "(host work in its calls, work off the timed stream, or the harness's jitter around "
                     "small calls), so it was timed by that clock")
    if floor_hit:
        return r.suspicious(c, lp, f"faster than the roofline floor on {floor_hit}: impossible, so not trusted",
                             timings=timings, speedup=speedup, noise_band=band, flags=flags,
                             **{**numbers, "max_abs": None, "max_rel": None, "error": None})
    return Trial(**r.trial_fields(c, lp), status=Status.ok, reason="within tolerance", timings=timings, speedup=speedup,
                 noise_band=band, flags=flags, screen=record, **numbers)


def measure(r: TimingRunner, lp: Loaded, budget_ms: float, retimed: list[str]) -> list[WorkloadTiming]:
    """Each workload timed; `retimed` gets a line for each one timed twice for a wide band."""
    out = []
    for i, w in enumerate(lp.problem.workloads):
        checks: list[Callable[[], None]] = []
        out.append(_segment(r, lp, w.name, checks, functools.partial(_whole, r, lp, i, w.name, budget_ms, checks,
                                                                     retimed)))
    return out


def screened(r: TimingRunner, lp: Loaded, budget_ms: float,
             screen: ScreenBar) -> tuple[list[WorkloadTiming], dict | None]:
    """The first round of every workload, then the other rounds only for a contender. Returns the
    timings and the screen's record where it read the candidate clearly slower (then, unless the
    record says `audited`, the timings are those first rounds: never the trial's)."""
    started = []
    for i, w in enumerate(lp.problem.workloads):
        checks: list[Callable[[], None]] = []
        rounds = _rounds(r, lp, i, w.name, budget_ms, checks, screen=True)
        started.append((w.name, rounds, checks, _segment(r, lp, w.name, checks, lambda g=rounds: _advance(g)[0])))
    record = verdict(screen, lp.problem.weights, [first for *_, first in started])
    if record is not None and not record["audited"]:  # no device work left: each first round's numbers
        return [_advance(g, False)[1] for _, g, _, _ in started], record
    return [_segment(r, lp, name, checks, lambda g=g: _advance(g, True)[1]) for name, g, checks, _ in started], record


def _whole(r: TimingRunner, lp: Loaded, i: int, name: str, budget_ms: float,
           checks: list[Callable[[], None]], retimed: list[str]) -> WorkloadTiming:
    """Workload `i` timed in all its rounds (a whole model's wide band once more)."""
    got = _workload(r, lp, i, name, budget_ms, checks)
    if lp.problem.is_whole_model and got.timing_kind == "cuda" and got.noise_band > WIDE_BAND:
        again = _workload(r, lp, i, name, budget_ms, checks)  # its spot checks run too
        retimed.append(f"{name} ±{got.noise_band:.1%} then ±{again.noise_band:.1%}")
        got = min(got, again, key=lambda t: t.noise_band)
    return got


def _advance(gen: Generator, go_on: bool | None = None) -> tuple[Any, Any]:
    """A workload's timing run to its next pause: (what it paused with, None), or (None, its timing)."""
    try:
        return gen.send(go_on), None
    except StopIteration as done:
        return None, done.value


def _segment(r: TimingRunner, lp: Loaded, name: str, checks: list[Callable[[], None]],
             work: Callable[[], Any]) -> Any:
    """`work` (timing on the device) under the device lock with every sibling worker stopped, then
    the spot checks it left in `checks`, off the lock."""
    t_wait = time.monotonic()
    r.step("waiting for the device")
    # The tuner's judges finish before the device lock is taken, never while it is held: a
    # timing that waited for a judge under the lock held the GPU idle (about a third of a
    # search's lock time on the H200, 2026-12-05).
    with r.host_quiet.timing(lp.problem.is_whole_model), r.device_lock, r.quiet():
        t0 = time.monotonic()  # a wait for a sibling's verification or timing, or a judge, is lock_wait
        r.phases["lock_wait"] = r.phases.get("lock_wait", 0.0) + t0 - t_wait
        r.step(f"timing {name}")  # nothing of a sibling worker runs beside a timing
        got = work()
    r.phases["time"] = r.phases.get("time", 0.0) + time.monotonic() - t0
    # The spot checks' answers (the reference worker's, kept by seed) and comparisons: off the
    # device lock (another runner verifies meanwhile), never beside a whole model's timing
    # (nor beside any timing where the host has few cores: HostQuiet).
    if checks:
        t_check = time.monotonic()
        with r.host_quiet.busy():
            r.phases["spot_wait"] = r.phases.get("spot_wait", 0.0) + time.monotonic() - t_check
            for check in checks:
                check()
        checks.clear()
        r.phases["spot_judge"] = r.phases.get("spot_judge", 0.0) + time.monotonic() - t_check
    return got


@contextlib.contextmanager
def _phase(r: TimingRunner, name: str):
    """The block's seconds added to the trial's phase `name` (bench/trial_cost.py prints them)."""
    t0 = time.monotonic()
    try:
        yield
    finally:
        r.phases[name] = r.phases.get(name, 0.0) + time.monotonic() - t0


def _workload(r: TimingRunner, lp: Loaded, i: int, name: str, budget_ms: float,
              checks: list[Callable[[], None]]) -> WorkloadTiming:
    """Workload `i` timed in all its rounds; `checks`: each spot check's comparison, to run once
    the device lock is let go."""
    return _advance(_rounds(r, lp, i, name, budget_ms, checks))[1]


def _rounds(r: TimingRunner, lp: Loaded, i: int, name: str, budget_ms: float,
            checks: list[Callable[[], None]], screen: bool = False) -> Generator:
    """Workload `i`'s timing; its value (StopIteration's) is the WorkloadTiming. With `screen` it pauses after the
    first round (spot-checked always, its output fetched before the control's run; the integrity
    check done), yielding that round's timing, and goes on only when sent True."""
    from sandbox.seeds import seed
    lim, p = r.limits, lp.problem
    ref, cand = r.reference, r.worker
    n = _elements(lp, i)
    s = seed()
    warm = WARMUP_REPS["cpu" if r.device == "cpu" else "cuda"]
    with _phase(r, "time.warmup"):
        wb, wall_wb = runs.batch(ref, {"problem": p.name, "set": i, "seed": s, "reps": warm, "key_len": n},
                             lim.time_s, cand)
        wc, wall_wc = runs.batch(cand, {"set": i, "seed": s, "reps": warm, "key_len": n}, lim.time_s)
    # One repetition of both sides costs the tuner's clock its calls plus the harness around them
    # (fresh inputs, copies, checksums): with small calls the harness is most of it, and a budget
    # sized by the calls alone would cost many times itself.
    # (less each side's one copy of the input set to its device, done in this first run only)
    est = max(statistics.median(runs.samples_of(wb)) + statistics.median(runs.samples_of(wc)),
              max(0.0, wall_wb - runs.upload_ms(wb) + wall_wc - runs.upload_ms(wc)) / warm)
    rounds = max(2, lim.rounds)
    reps = repetitions(p.is_whole_model, wb.header.get("timing_kind", "cpu"), budget_ms, rounds, est, lim.max_reps)
    # One lead for both sides, in device cycles of the reference worker's calibration, so the
    # two runs' walls differ by their calls' device time and nothing else. The whole model runs
    # without one: what a forward costs there includes the host's launches (a region's kernels
    # are compared by device time, as do_bench does; a model by what its user waits for).
    cycles = float(wb.header.get("cycles_per_ms") or 0.0)
    lead = 0.0 if p.is_whole_model else max(runs.lead_ms(wb, reps), runs.lead_ms(wc, reps))
    base_runs: list[list[float]] = []
    cand_runs: list[list[float]] = []
    parent: list[float] = []
    aa: list[float] = []
    spot = random.SystemRandom()
    for k in range(rounds):
        s = seed()
        req = {"set": i, "seed": s, "reps": reps, "key_len": n, "lead_cycles": lead * cycles}
        # The repetition a spot check would take, drawn now and told to the reference worker only
        # (it keeps that repetition's answer); whether this round is checked is drawn after it ran.
        j = spot.randrange(reps)

        def original(lead_ms: float, req: dict = req, j: int = j) -> tuple["Reply", float]:
            rb, wall_b = runs.batch(ref, {"problem": p.name, **req, "lead_cycles": lead_ms * cycles, "keep_index": j},
                                lim.time_s, cand)
            runs.note_harness(r, rb)
            # less the reference worker's (trusted) copy of the set to the device, were it evicted
            return rb, wall_b - runs.upload_ms(rb)
        with _phase(r, "time.runs"):
            samples, per_call, lead, rb = runs.candidate_run(r, lp, req, original, lead, cycles)
        base_runs.append(runs.samples_of(rb))
        cand_runs.append(samples)
        parent.append(per_call)
        last = k == rounds - 1 or (k == 1 and not p.is_whole_model and _clearly_slower(base_runs, cand_runs))
        if last and not p.is_whole_model:
            # Fetched once the device lock is let go (0.3 s a trial under it on the H100): after
            # a region's last round its worker runs only the integrity check before the fetch.
            checks.append(functools.partial(_fetch_and_check, r, lp, i, s, j, list(r.last_checksums)))
        elif last or (screen and k == 0) or spot.random() < SPOT_CHANCE:  # a screen's round: always
            with _phase(r, "time.spot"):
                checks.append(_spot_check(r, lp, i, s, j))
        if k == 0 or p.is_whole_model:
            # A/A across the two processes: the original in the candidate's worker. A whole model
            # gets one every round: its host-bound workloads move most from process to process.
            with _phase(r, "time.control"):
                ctl, _ = runs.batch(cand, {**req, "control": True}, lim.time_s)
            aa.append(timing.stats(runs.samples_of(ctl)).median_ms / max(timing.stats(base_runs[-1]).median_ms, 1e-9))
        if screen and k == 0:
            with _phase(r, "time.integrity"):
                _tamper(r)
            if not (yield _timing(name, wb, base_runs, cand_runs, parent, aa)):
                return _timing(name, wb, base_runs, cand_runs, parent, aa)  # the screen's round: its record only
        if last:
            break
    with _phase(r, "time.integrity"):  # once per workload: a patch that outlives a batch is seen here
        _tamper(r)
    return _timing(name, wb, base_runs, cand_runs, parent, aa)


def _timing(name: str, wb: "Reply", base_runs: list[list[float]], cand_runs: list[list[float]], parent: list[float],
            aa: list[float]) -> WorkloadTiming:
    base = timing.stats([x for run in base_runs for x in run])
    cnd = timing.stats([x for run in cand_runs for x in run])
    medians = [timing.stats(run).median_ms for run in base_runs]
    kind = wb.header.get("timing_kind", "cpu")
    cand_medians = [timing.stats(run).median_ms for run in cand_runs]
    band = ab_band(medians, cand_medians, aa, kind)
    return WorkloadTiming(workload=name, baseline_ms=base.median_ms, candidate_ms=cnd.median_ms,
                          baseline_spread=base.spread, candidate_spread=cnd.spread, reps=cnd.reps,
                          speedup=base.median_ms / max(cnd.median_ms, 1e-9), timing_kind=kind,
                          noise_band=band, parent_ms=statistics.median(parent),
                          baseline_runs=medians, candidate_runs=cand_medians, controls=list(aa))


def _fetch_and_check(r: TimingRunner, lp: Loaded, i: int, s: int, j: int, sums: list[float]) -> None:
    _spot_check(r, lp, i, s, j, sums)()


def repetitions(whole_model: bool, kind: str, budget_ms: float, rounds: int, est_ms: float, most: int) -> int:
    """Repetitions per round: the budget over the rounds and one repetition's estimated cost, at
    least MIN_REPS (WHOLE_MODEL_MIN_REPS for a whole model on a GPU), at most `most`."""
    least = WHOLE_MODEL_MIN_REPS if whole_model and kind == "cuda" else MIN_REPS
    return int(max(least, min(most, budget_ms / rounds / max(est_ms, 1e-3))))


def _clearly_slower(base_runs: list[list[float]], cand_runs: list[list[float]]) -> bool:
    """Every round so far read a speedup of CLEARLY_SLOWER or less."""
    return all(statistics.median(b) <= CLEARLY_SLOWER * statistics.median(c) for b, c in zip(base_runs, cand_runs))


def ab_band(base_medians: list[float], cand_medians: list[float], controls: list[float], kind: str) -> float:
    """The A/A noise band of one workload: how far each side's runs move against themselves,
    how far their paired ratio moves from round to round (load that hits one process and not
    the other shows there first), and the original across the two processes (`controls`: its
    median in the candidate's worker over the reference worker's). A control shows an offset
    between the processes that the candidate's ratio carries too, plus that ratio's own noise:
    the widest control, counted as the verdict reads it (`faster` above 1 + band, `slower` below
    1 / (1 + band): x or 1/x, less one), plus the ratio's spread. Controls only widen the band,
    so a candidate that disturbs its own worker's control cannot buy itself a win."""
    parts = timing.band_parts(base_medians, cand_medians, controls, kind)
    spread, cross = parts["ratio"], parts["control"]
    return max(parts["original"], parts["candidate"], spread, cross + spread if cross else 0.0)


def _tamper(r: TimingRunner) -> None:
    reply = r.worker.request({"op": "integrity"}, timeout=r.limits.run_s)
    if not reply.ok:
        raise Refused("crash", reply.error, reply)
    if reply.header.get("tampered"):
        raise Refused("suspicious", "the candidate replaced functions of torch or the harness during timing: "
                      + ", ".join(reply.header["tampered"][:5]))


def _below_floor(lp: Loaded, timings: list[WorkloadTiming]) -> list[str]:
    return [t.workload for t in timings if t.timing_kind == "cuda"
            and t.candidate_ms < 0.9 * lp.problem.floor_ms.get(t.workload, 0.0)]


def weighted_speedup(problem, timings: list[WorkloadTiming]) -> float:
    w = problem.weights
    base = sum(w[t.workload] * t.baseline_ms for t in timings)
    cand = sum(w[t.workload] * t.candidate_ms for t in timings)
    return base / cand if cand > 0 else math.inf


def weighted_band(problem, timings: list[WorkloadTiming]) -> float:
    """The workloads' bands weighted by their share of the baseline time."""
    w = problem.weights
    total = sum(w[t.workload] * t.baseline_ms for t in timings)
    return sum(w[t.workload] * t.baseline_ms * t.noise_band for t in timings) / total if total > 0 else 0.0
