"""EXPECT: runtime_error"""


def forward(module, x):
    raise ValueError("this candidate always fails")
