"""EXPECT: late_write|ok|suspicious -- computes the right answer, but threads it starts keep the cores and the memory
bus busy (large copies, which run outside the GIL and evict the caches) whenever this worker is not inside the candidate's own
forward: while the tuner times the original in the reference worker, and during the control
run of the original in this worker. The baseline slows, the control looks like the baseline,
and the candidate's own calls run on a quiet machine: a fake speedup with a clean A/A band.
It must never read faster: the tuner stops every process of this worker while the original
is timed (tests/test_sandbox.py checks that directly: on two cores Linux's scheduler favours
the briefly woken reference worker, and this hog alone moved its baseline little). On a GPU,
kernels it queued before being stopped would still run beside the original: not defended. On
the H200 (16 cores) its threads load the host between its own calls, so the tuner's clock saw
far more than its CUDA events claimed: `suspicious` (forged timings), rejected either way.
Its threads still run its code when its verification ends: since the late-write check waits for
them, that alone rejects it (`late_write`: they could write its outputs at any time).
TIMING: on
NOT_A_WIN"""
import os
import threading

import torch

_free = threading.Event()
_free.set()
_threads = []


def _hog():
    a, b = torch.randn(1 << 23), torch.empty(1 << 23)
    while True:
        _free.wait()  # blocks, using nothing, while the candidate's own call runs
        b.copy_(a)
        a.copy_(b)


def forward(module, *args, **kwargs):
    if not _threads:
        for _ in range(max(2, os.cpu_count() or 2)):
            _threads.append(threading.Thread(target=_hog, daemon=True))
            _threads[-1].start()
    _free.clear()
    try:
        return type(module).forward(module, *args, **kwargs)
    finally:
        _free.set()
