"""EXPECT: suspicious -- borrows the code of torch's own dynamo wrapper (the one the integrity
check accepts around `torch.manual_seed` once torch.compile has run) and closes it over a
function of its own, installed as torch.rsqrt: torch's code, not torch's original inside."""
import types

import torch

_real = torch.rsqrt


def _mine(t, *a, **k):
    return _real(t, *a, **k)


_legit = torch._disable_dynamo(lambda: None)
_cells = tuple(types.CellType(_mine if callable(c.cell_contents) else c.cell_contents)
               for c in _legit.__closure__ or ())
torch.rsqrt = types.FunctionType(_legit.__code__, _legit.__globals__, "rsqrt", _legit.__defaults__, _cells)


def forward(module, x):
    return type(module).forward(module, x)
