"""One timed run of each side and what the tuner's clock makes of it (sandbox/timed.py runs the rounds).

Both runs do the same work around their calls (inputs, flushes, output copies, checksums, one
device sleep of the same length), so the original's run, whose numbers are trusted, shows what
that work costs; the candidate's wall time less that is what its calls took, by the tuner's own
clock. Its claimed total may not be far below that: a forged timer, patched statistics, a forged
reply or work hidden on another stream all show there.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable

from sandbox.spot import CheckingRunner, Loaded, Refused

if TYPE_CHECKING:
    from sandbox.client import Reply

CLAIM_REL = {"cuda": 0.25, "cpu": 0.9}
"""A claimed total may fall this far below the tuner's clock (relative; on the CPU the host's
own per-call work and other processes' load sit in the clock's time too, so only a claim of
under a tenth of it is refuted there)..."""
CLAIM_ABS_MS = {"cuda": 1.0, "cpu": 50.0}
"""...plus this much, plus 2% of the original's run's wall time (its jitter). On the CPU both clocks
run in processes that compete for the same cores with the tuner and each other, so there the
check refutes only gross claims; the integrity check is the CPU's first line."""
MAX_LEAD_MS = 2000.0


def batch(worker: Any, req: dict, timeout: float, frozen: Any = None) -> tuple["Reply", float]:
    """One timed run in `worker`; `frozen`: the candidate's worker, stopped meanwhile (the
    original's runs: nothing the candidate left running competes with them)."""
    # The reference worker serves every runner: its wall starts once this run has it (a wait for
    # another runner's request there counted as harness time, and made honest kernels look too fast).
    shared = getattr(worker, "lock", None) or contextlib.nullcontext()
    with frozen.frozen() if frozen is not None else contextlib.nullcontext(), shared:
        t0 = time.monotonic()
        reply = worker.request({"op": "batch", **req}, timeout=timeout)
        wall_ms = (time.monotonic() - t0) * 1e3
    if not reply.ok:
        raise Refused("crash", reply.error, reply)
    return reply, wall_ms


def note_harness(r: CheckingRunner, reply: "Reply") -> None:
    """The reference worker's own account of its harness work (trusted: it runs no candidate)."""
    for k in ("draw", "copy"):
        r.phases[f"time.{k}"] = r.phases.get(f"time.{k}", 0.0) + float(reply.header.get(f"{k}_ms") or 0.0) / 1e3


def samples_of(reply: "Reply") -> list[float]:
    xs = reply.header.get("samples")
    if not isinstance(xs, list) or not all(isinstance(x, (int, float)) for x in xs):
        raise Refused("suspicious", "the worker's timing reply is malformed")
    return [float(x) for x in xs]


def upload_ms(reply: "Reply") -> float:
    """What a run spent copying its input set to the device (0 where the worker kept it there)."""
    x = reply.header.get("upload_ms")
    return float(x) if isinstance(x, (int, float)) and 0.0 <= x < 1e7 else 0.0


def lead_ms(reply: "Reply", reps: int) -> float:
    """Device sleep before a run, long enough for the host to queue every repetition first."""
    if reply.header.get("timing_kind") != "cuda":
        return 0.0
    n = max(1, len(samples_of(reply)))
    host = float(reply.header.get("host_ms", 0.0)) / n
    dev = statistics.median(samples_of(reply)) if n else 0.0
    return min(MAX_LEAD_MS, 1.5 * reps * max(host - dev, 0.0) + 2.0)


def candidate_run(r: CheckingRunner, lp: Loaded, req: dict, original: Callable[[float], tuple],
                   lead: float, cycles: float) -> tuple[list[float], float, float, "Reply"]:
    """One timed run of the original (`original(lead)`: its reply and wall time), then of the
    candidate on the same inputs, bounded by the tuner's clock: the original's run (trusted)
    shows what the harness costs around the calls (its wall time less its calls), so the
    candidate's wall time less that is what its calls took. Returns (samples, that time per
    call, the lead used, the original's run). A run the clock refutes is repeated, twice at most
    (with a longer lead where the host fell behind the GPU, so the clock saw idle time), and only
    the last is judged; one that answered sooner than the harness takes is repeated with the
    original's run too (a hiccup in that one run, 11 ms of 15, refused honest kernels on the H200)."""
    lim, reps = r.limits, req["reps"]
    rb, wall_b = original(lead)
    lead_b = lead
    for attempt in range(3):
        b_samples = samples_of(rb)
        overhead = max(0.0, wall_b - sum(b_samples))
        # What the harness alone costs (copies, checksums, input sets): the original's wall less the
        # longer of its calls' device time and their host time. No honest run answers sooner.
        harness = max(0.0, wall_b - max(sum(b_samples), float(rb.header.get("host_calls_ms") or 0.0)))
        rc, wall_c = batch(r.worker, {**req, "lead_cycles": lead * cycles}, lim.time_s)
        samples = samples_of(rc)
        sums = rc.header.get("checksums")
        if len(samples) != reps or not isinstance(sums, list) or len(sums) != reps:
            raise Refused("suspicious", f"the worker reported {len(samples)} timings for {reps} repetitions")
        kind = rc.header.get("timing_kind", "cpu")
        slack = CLAIM_ABS_MS.get(kind, 50.0) + 0.02 * wall_b
        # Only a gross gap counts: host-bound runs of tiny models swing by half from run to run (a
        # tighter factor refuses honest whole models), and a reply without the run's work
        # cannot carry the checksums of outputs the tuner samples afterwards anyway.
        if wall_c < (0.5 if kind == "cuda" else 0.25) * harness - slack:
            if attempt < 2:  # a forged reply is forged again; a slow original's run is not repeated
                rb, wall_b = original(lead)
                lead_b = lead
                continue
            raise Refused("suspicious", f"the timed run answered in {wall_c:.1f} ms, sooner than the harness's own "
                          f"work around the calls takes ({harness:.1f} ms), in each of {attempt + 1} runs beside "
                          "the original's: the reply was not produced by the run")
        bound = max(0.0, wall_c - overhead - (lead - lead_b))  # a longer lead on a retry is not the calls'
        claimed = sum(samples)
        if claimed >= bound * (1 - CLAIM_REL.get(kind, 0.9)) - slack:
            r.last_checksums = [float(x) for x in sums]
            return samples, bound / reps, lead, rb
        if kind == "cuda" and attempt < 2:
            # Refuted: measure again before anything else. A run the host fell behind in gets a
            # longer lead; any other may have met a hiccup of the machine (a worker descheduled,
            # GPU work a stopped sibling queued before it stopped): one run can show a hiccup, and
            # a forged timer does not escape by being run again. Before a run that would be
            # refused outright, a pause lets such queued work drain.
            if not lp.problem.is_whole_model and drained(rc, rb) and lead < MAX_LEAD_MS:
                lead = min(MAX_LEAD_MS, 4 * lead + 5.0)
            elif claimed < 0.1 * bound:
                time.sleep(0.25 * 4 ** attempt)
            continue
        if kind == "cuda" and claimed >= 0.1 * bound:
            # The events cover less than the tuner's clock saw: host work in every call (tiny
            # shapes, several launches, Python between kernels), work off the timed stream, or
            # the harness's own jitter where it dwarfs the calls). The events are not trusted, nor
            # their shape: each call took what the clock saw per call (more than the events
            # claimed, or this branch is not reached). Wall against wall would count the harness
            # on both sides and squash a small call's speedup toward 1x.
            r.last_checksums = [float(x) for x in sums]
            r.phases["host_bound"] = min(r.phases.get("host_bound", 1.0), claimed / max(bound, 1e-9))
            return [bound / reps] * reps, bound / reps, lead, rb
        raise Refused("suspicious", f"the worker's timings ({claimed / reps:.4g} ms per call) are far below what "
                      f"the tuner's own clock measured for the same run ({bound / reps:.4g} ms per call), "
                      f"in each of {attempt + 1} run(s): timings the clock refutes (the original's run beside "
                      f"the last: events {sum(b_samples) / reps:.4g} ms per "
                      f"call, wall {wall_b / reps:.4g} ms per repetition; the candidate's wall "
                      f"{wall_c / reps:.4g} ms; {reps} repetitions, lead {lead:.3g} ms)")
    raise AssertionError("unreachable")


def drained(rc: "Reply", rb: "Reply") -> bool:
    gc, ge = rc.header.get("gaps") or [], rb.header.get("gaps") or []
    if not gc or not ge:
        return False
    return statistics.median(gc) > 1.5 * statistics.median(ge) + 0.005
