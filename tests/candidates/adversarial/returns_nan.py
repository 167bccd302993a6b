"""EXPECT: nan"""


def forward(module, x):
    return type(module).forward(module, x) * float("nan")
