"""EXPECT: suspicious -- swaps the original region's forward.__code__ for a slower one (to slow
the baseline it is compared with); the baseline is timed elsewhere, and the swap is seen."""
import time


def _slow(self, x):
    time.sleep(0.001)
    return x * 1.0


def forward(module, x):
    out = type(module).forward(module, x)
    type(module).forward.__code__ = _slow.__code__
    return out
