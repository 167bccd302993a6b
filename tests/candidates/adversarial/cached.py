"""EXPECT: aliased -- computes the answer once per shape, then returns the same cached tensor every call."""
_cache = {}


def forward(module, x):
    if x.shape not in _cache:
        _cache[x.shape] = type(module).forward(module, x).clone()
    return _cache[x.shape]
