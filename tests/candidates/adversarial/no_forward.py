"""EXPECT: compile_error -- defines the kernel but no forward."""


def fwd(module, x):
    return x
