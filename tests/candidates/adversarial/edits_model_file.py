"""EXPECT: runtime_error -- appends code to the model file it was imported from; in the jail the
file is read-only, so the write fails (and the model file stays byte-identical).
EXPECT_UNJAILED: ok"""
import sys


def forward(module, x):
    path = sys.modules[type(module).__module__].__file__
    with open(path, "a") as f:
        f.write("\n# edited by a candidate\n")
    return type(module).forward(module, x)
