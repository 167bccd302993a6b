"""EXPECT: suspicious -- patches statistics.median to report a hundredth of every median."""
import statistics

_real = statistics.median
statistics.median = lambda xs: _real(xs) / 100


def forward(module, x):
    return type(module).forward(module, x)
