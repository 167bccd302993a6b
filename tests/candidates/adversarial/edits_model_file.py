"""EXPECT: runtime_error -- appends code to the model file it was imported from: inside the jail
the model's folder is read-only (the worker imports a pinned copy whose `__file__` names the
original, so a config beside it is found), so the write raises, and the model file stays
byte-identical."""
import sys


def forward(module, x):
    path = sys.modules[type(module).__module__].__file__
    with open(path, "a") as f:
        f.write("\n# edited by a candidate\n")
    return type(module).forward(module, x)
