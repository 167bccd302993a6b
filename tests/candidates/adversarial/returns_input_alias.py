"""EXPECT: mutated_input|aliased -- computes in place in its input and returns the input."""


def forward(module, x):
    x.copy_(type(module).forward(module, x))
    return x
