"""EXPECT: ignored_parameter -- caches answers by a hash of the input's contents, not of the parameters:
right on the frozen and fresh inputs, but the copy with perturbed parameters gets an answer
computed with the original ones."""
_cache = {}


def forward(module, x):
    key = (tuple(x.shape), float(x.double().sum()), float(x.double().abs().sum()))
    if key not in _cache:
        _cache[key] = type(module).forward(module, x)
    return _cache[key].clone()
