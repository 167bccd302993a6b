"""What a tuned forward may have specialised on in one module instance, as a short digest.

A winner is verified on the instances of its class that the run saw: the region's frozen one,
and, once integration kept it end to end, every instance in the model. The module `agent apply`
writes routes only instances with one of those digests through it; another instance of the
class (an eps of 0.5 where the kernel has 1e-5 built in, another model's LayerNorm in the same
process) keeps its original forward. The function is copied verbatim into that module, so it
imports what it needs itself and depends on nothing else here.
"""


def instance_fingerprint(module) -> str:
    """The class name, plain attributes (numbers, strings, None, and tuples or lists of those) and
    each parameter's and buffer's name, shape and dtype, of the module and of every submodule.
    Not values of tensors, not the device, not `training` or `requires_grad`."""
    import hashlib

    def plain(v):
        if v is None or isinstance(v, (bool, int, float, str)):
            return True
        return isinstance(v, (tuple, list)) and all(plain(x) for x in v)
    parts = []
    for path, m in module.named_modules(remove_duplicate=False):
        attrs = sorted((k, repr(v)) for k, v in vars(m).items()
                       if not k.startswith("_") and k != "training" and plain(v))
        parts.append((path, type(m).__qualname__, attrs))  # not its module: the model file's name varies
    for kind, named in (("p", module.named_parameters(remove_duplicate=False)),
                        ("b", module.named_buffers(remove_duplicate=False))):
        parts += [(kind, name, tuple(t.shape), str(t.dtype)) for name, t in named if t is not None]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]
