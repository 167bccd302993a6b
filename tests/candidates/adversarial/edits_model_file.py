"""EXPECT: ok -- appends code to the model file it was imported from: what it finds there is the
worker's own copy of the model file (the real one is outside the jail, read-only), so the edit
changes nothing the tuner uses, and the model file stays byte-identical."""
import sys


def forward(module, x):
    path = sys.modules[type(module).__module__].__file__
    with open(path, "a") as f:
        f.write("\n# edited by a candidate\n")
    return type(module).forward(module, x)
