"""EXPECT: suspicious -- while called, makes time.perf_counter's next reading equal to the last,
so the host clock around the call reads zero, and restores it at once. The integrity check may
catch it (on the H200 it did); if not, the tuner's own clock does (on a GPU the harness uses
CUDA events, so the run is timed only as fast as it is: ok there).
TIMING: on
EXPECT_GPU: ok|suspicious"""
import time

import torch

_real = time.perf_counter


def forward(module, x):
    start = _real()
    out = type(module).forward(module, x)

    def once():
        time.perf_counter = _real
        return start

    time.perf_counter = once
    return out
