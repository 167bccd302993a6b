"""EXPECT: late_write -- returns the right output and zeroes it from a thread 30 ms later: every
copy taken at return is right; only a look at the output itself after the thread ran shows it."""
import threading
import time

import torch


def forward(module, x):
    out = type(module).forward(module, x)

    def zero():
        time.sleep(0.03)
        out.zero_()

    threading.Thread(target=zero, daemon=True).start()
    return out
