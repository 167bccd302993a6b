"""EXPECT: suspicious -- wraps the real torch.rsqrt in code of its own dressed as torch's dynamo
wrapper (its file name, function name and first line copied): the original is inside, but the
code is not torch's, so the integrity check must not accept it."""
import torch

_real = torch.rsqrt
_legit = torch._disable_dynamo(lambda: None).__code__


def _make(original):
    def inner(*args, **kwargs):
        return original(*args, **kwargs)
    return inner


_fake = _make(_real)
_fake.__code__ = _fake.__code__.replace(co_filename=_legit.co_filename, co_name=_legit.co_name,
                                        co_firstlineno=_legit.co_firstlineno, co_qualname=_legit.co_qualname)
torch.rsqrt = _fake


def forward(module, x):
    return type(module).forward(module, x)
