"""EXPECT: late_write -- returns a tensor at once and lets a thread write the answer into it a
little later (a lazy output: timed, it would look free)."""
import threading
import time

import torch


def forward(module, x):
    out = torch.zeros_like(x)

    def fill():
        time.sleep(0.005)
        out.copy_(type(module).forward(module, x))

    threading.Thread(target=fill, daemon=True).start()
    return out
