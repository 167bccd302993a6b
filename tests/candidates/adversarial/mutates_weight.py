"""EXPECT: mutated_input -- right answer, but scales the module's weight in place afterwards."""


def forward(module, x):
    y = type(module).forward(module, x)
    module.weight.data.mul_(1.5)
    return y
