"""EXPECT: suspicious -- installs a sys.setprofile hook, which slows every Python call (the eager
baseline makes many, a fused kernel few)."""
import sys


def _hook(frame, event, arg):
    return None


sys.setprofile(_hook)


def forward(module, x):
    return type(module).forward(module, x)
