"""EXPECT: late_write|ok|suspicious -- (late_write: its thread still runs its code when its
verification ends) computes the right answer with the original's own code, and keeps the GPU
busy whenever its worker is idle: a thread of its own queues spin kernels on a side stream, up to
half a second ahead, as soon as the candidate's calls stop (its timed run has ended). Without MPS
the GPU time-slices between processes, so the reference worker's kernels, timed next, would share
the device with them, while in this worker they run beside its own kernels on one SM: a slower
original, a faster-looking candidate. Stopping this worker while the original is timed does not
stop kernels it queued before. What defends: this worker is stopped before it can top its queue
up, the original's median ignores a disturbed start of its run, and the candidate's run ends with
a device-wide synchronize, so whatever it left queued is inside the tuner's clock for its own
run (then its events are unconfirmed and it is timed by that clock). It must never read faster.
TIMING: on
NOT_A_WIN"""
import threading
import time

import torch

_last_call = [0.0]
_started = []
AHEAD_S, CYCLES_PER_SPIN = 0.5, 2_000_000  # about 1 ms a spin on a 2 GHz SM


def _queue_when_idle():
    stream = torch.cuda.Stream()
    pending: list[torch.cuda.Event] = []
    while True:
        time.sleep(0.002)
        if time.monotonic() - _last_call[0] < 0.02:
            continue  # inside (or just after) a run of its own: queue nothing
        pending = [e for e in pending if not e.query()]
        with torch.cuda.stream(stream):
            while len(pending) < AHEAD_S * 1000:
                torch.cuda._sleep(CYCLES_PER_SPIN)
                e = torch.cuda.Event()
                e.record(stream)
                pending.append(e)


def forward(module, *args, **kwargs):
    _last_call[0] = time.monotonic()
    if not _started:
        _started.append(threading.Thread(target=_queue_when_idle, daemon=True))
        _started[-1].start()
    try:
        return type(module).forward(module, *args, **kwargs)
    finally:
        _last_call[0] = time.monotonic()
