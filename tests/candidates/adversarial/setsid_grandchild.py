"""EXPECT: ok -- leaves a grandchild (double fork, setsid) that would outlive its trial and
rewrite the store later; it must die with the trial's worker."""
import os
import time

MARK = "{marker}"


def _daemon():
    if os.fork():
        return
    os.setsid()
    if os.fork():
        os._exit(0)
    try:
        os.execvp("sleep", ["sleep", "600", MARK])
    finally:
        os._exit(0)


_daemon()


def forward(module, x):
    return type(module).forward(module, x)
