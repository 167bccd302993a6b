"""EXPECT: late_write|uninitialized|wrong|nondeterministic -- a thread races to write the answer
after the call has returned; whichever check sees it first rejects it."""
import threading

import torch


def forward(module, x):
    out = torch.empty_like(x)
    threading.Thread(target=lambda: out.copy_(type(module).forward(module, x)), daemon=True).start()
    return out
