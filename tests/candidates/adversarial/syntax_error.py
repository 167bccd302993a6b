"""EXPECT: compile_error"""
def forward(module, x)
    return x
