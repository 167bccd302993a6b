"""EXPECT: suspicious -- while called, makes time.perf_counter's next reading equal to the last,
so the host clock around the call reads zero, and restores it at once: the integrity check sees
nothing, the tuner's own clock does (on a GPU the harness uses CUDA events, and the run is only
as fast as it is).
TIMING: on
EXPECT_GPU: ok"""
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
