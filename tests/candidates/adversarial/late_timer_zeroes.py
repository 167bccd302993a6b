"""EXPECT: late_write -- returns the right output and lets a threading.Timer zero it 3 s later,
long after any pause a harness would wait: the timer still pending when the calls are done is
itself the late write (no frame of candidate code runs in it until it fires)."""
import threading


def forward(module, x):
    out = type(module).forward(module, x)
    threading.Timer(3.0, out.zero_).start()
    return out
