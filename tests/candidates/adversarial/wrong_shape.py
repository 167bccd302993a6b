"""EXPECT: shape"""


def forward(module, x):
    return type(module).forward(module, x)[..., :-1]
