"""EXPECT: mutated_input -- computes the right answer, then zeroes its input."""


def forward(module, x):
    y = type(module).forward(module, x)
    x.zero_()
    return y
