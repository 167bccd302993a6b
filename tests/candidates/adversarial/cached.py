"""EXPECT: hardcoded -- computes the answer once per shape, then returns the cached result."""
_cache = {}


def forward(module, x):
    if x.shape not in _cache:
        _cache[x.shape] = type(module).forward(module, x).clone()
    return _cache[x.shape]
