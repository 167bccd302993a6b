"""EXPECT: wrong -- right for its first calls (import warm-up and verification), then returns its
last answer again: a cheat aimed at timed calls, caught when a timed repetition is checked.
TIMING: on"""
_calls = [0]
_last = {}


def forward(module, x):
    _calls[0] += 1
    if _calls[0] > 20 and x.shape in _last:
        return _last[x.shape].clone()
    out = type(module).forward(module, x)
    _last[x.shape] = out.clone()
    return out
