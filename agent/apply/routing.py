"""The routing code at the end of every generated kernels module (`<model>_nightshift.py`).

`install(namespace)` points each region class's `forward` at its tuned forward. A class of the
model file is found in the model module's globals (`namespace`); a class defined elsewhere, in
code the user does not own (transformers' modules in site-packages), is found by importing its
module by name and is patched in this process only: no file outside the model's folder is ever
edited. NIGHTSHIFT_DISABLE=1 routes nothing. `compile_model(model, *example_inputs, mode=...)`
compiles the routed model with each tuned forward an opaque custom op (prompts/kernels/
_opaque_op.py.j2, the same code integration measures as "nightshift + <mode>").

At each call the routed forward keeps the original one for what was never verified (instances
of subclasses, training with autograd) and for what cannot run here: Triton kernels on tensors
that are not on a GPU, without Triton's interpreter (TRITON_INTERPRET=1). That fallback warns
once per process.
"""

RESERVED = {"REGIONS", "CLASSES", "MODULES", "NEEDS_GPU", "KERNEL_CHECKS", "VERIFIED", "UNDER_COMPILE", "install",
            "compile_model", "_nightshift_fingerprint", "_nightshift_seen", "_nightshift_key",
            "_nightshift_shapes", "_nightshift_compiler_runs",
            "_nightshift_route",
            "_nightshift_itertools", "_nightshift_MODULES", "_nightshift_OPS", "_nightshift_LIBS",
            "_nightshift_count", "_nightshift_kind", "_nightshift_shown", "_nightshift_Op", "_nightshift_record",
            "_nightshift_as_op", "_nightshift_verified_like", "_nightshift_recorded", "_nightshift_recording", "_nightshift_compile_kwargs",
            "_nightshift_os", "_nightshift_torch", "_nightshift_warnings", "_nightshift_importlib",
            "_nightshift_can_run", "_nightshift_fallback", "_nightshift_warned", "_nightshift_find",
            "_nightshift_unverified", "_nightshift_refused",
            "_nightshift_needs_grad", "_nightshift_grad_warned"}
"""Module-level names the routing code owns; candidates' names are renamed around them."""

IMPORTS = ["import importlib as _nightshift_importlib", "import itertools as _nightshift_itertools",
           "import os as _nightshift_os",
           "import torch as _nightshift_torch", "import warnings as _nightshift_warnings"]

ROUTING = '''

_nightshift_warned = []
_nightshift_grad_warned = []  # regions called with autograd on (warned once each)
_nightshift_refused = []  # regions whose tuned forward refused a call (warned once each)
_nightshift_recording = []  # non-empty while compile_model's eager call records each region's op


def _nightshift_can_run(module, args, kwargs):
    """Triton kernels need their tensors on a GPU, or Triton's CPU interpreter."""
    if _nightshift_os.environ.get("TRITON_INTERPRET", "").strip() == "1":
        return True
    for value in (*args, *kwargs.values()):
        if isinstance(value, _nightshift_torch.Tensor):
            return value.is_cuda
    first = next(module.parameters(), None)
    return first.is_cuda if first is not None else _nightshift_torch.cuda.is_available()


def _nightshift_fallback(region):
    if not _nightshift_warned:
        _nightshift_warned.append(region)
        _nightshift_warnings.warn(
            f"nightshift: the tuned Triton kernels ({region} and any other region) need a GPU, and these "
            "tensors are not on one (TRITON_INTERPRET=1 runs them on the CPU, slowly): the original "
            "forwards run instead", stacklevel=3)


def _nightshift_unverified(region, error):
    if region not in _nightshift_refused:
        _nightshift_refused.append(region)
        _nightshift_warnings.warn(f"nightshift: {region}'s tuned forward refused a call it was not verified on "
                                  f"({error}): the original forward runs for such calls", stacklevel=3)


def _nightshift_needs_grad(module, region, args, kwargs):
    """Autograd would record this call (training, or eval with a tensor or parameter that requires
    grad): the tuned kernels have no backward, so the original forward runs, said once."""
    if not _nightshift_torch.is_grad_enabled():
        return False
    training = getattr(module, "training", False)
    params = module.parameters() if isinstance(module, _nightshift_torch.nn.Module) else ()
    if not training and not any(p.requires_grad for p in params) and not any(
            isinstance(v, _nightshift_torch.Tensor) and v.requires_grad for v in (*args, *kwargs.values())):
        return False
    if not training and region not in _nightshift_grad_warned:
        _nightshift_grad_warned.append(region)
        _nightshift_warnings.warn(f"nightshift: {region} is called with autograd on; the tuned kernels have no "
                                  "backward, so its original forward runs (run inference under torch.no_grad() or "
                                  "torch.inference_mode() for the tuned kernels)", stacklevel=4)
    return True


def _nightshift_seen(module, region, verified, compiling=False):
    """Whether this instance is like one its region's winner was verified on (decided on its
    first eager call, kept on the instance; an instance first met while traced keeps the original)."""
    known = module.__dict__.get("_nightshift_verified")
    if compiling:
        return bool(known) and known.get(region, False)
    if known is None:
        known = module.__dict__["_nightshift_verified"] = {}
    if region not in known:
        known[region] = _nightshift_fingerprint(module) in verified
    return known[region]


def _nightshift_compiler_runs(region, args, kwargs):
    """Under torch.compile, whether this call is left to the region's own code (UNDER_COMPILE)."""
    shapes = UNDER_COMPILE.get(region)
    return shapes is not None and ("*" in shapes or _nightshift_key(args, kwargs) in shapes)


def _nightshift_route(cls, region, tuned):
    """Point cls.forward at `tuned`; installing again replaces the routing, never wraps it."""
    current = cls.__dict__.get("forward")
    original = getattr(current, "__nightshift_original__", None) or cls.forward
    needs_gpu = NEEDS_GPU.get(region, False)
    check = KERNEL_CHECKS.get(region)
    verified = VERIFIED.get(region)

    def forward(self, *args, **kwargs):
        # Instances of subclasses were never verified, nor instances unlike the ones the run saw,
        # and the tuned kernels define no backward and were verified for inference only: those
        # calls keep the original forward.
        compiling = _nightshift_torch.compiler.is_compiling()
        # Decided on eager calls (compile_model makes one first); traced, only what they decided is read.
        if type(self) is not cls or (not compiling and _nightshift_needs_grad(self, region, args, kwargs)) or (
                verified is not None and not _nightshift_seen(self, region, verified, compiling)):
            return original(self, *args, **kwargs)
        if compiling and _nightshift_compiler_runs(region, args, kwargs):
            return original(self, *args, **kwargs)  # the compiler's code was as fast here
        if (compiling or _nightshift_recording) and check is not None and not check(args, kwargs):
            # No kernel of ours for this call: the compiler compiles the original itself.
            if compiling:
                return original(self, *args, **kwargs)
            return _nightshift_record(self, region, tuned, args, kwargs, run=original)
        if compiling:
            made = _nightshift_as_op(self, args, kwargs)
            if made is not None:  # an opaque op: the compiler fuses around our kernel, never into it
                return made[1](made[0], args, kwargs)
            if _nightshift_recorded(self) and not _nightshift_verified_like(self, args, kwargs):
                return original(self, *args, **kwargs)  # unlike the eager call it was verified on: the compiler's
        if needs_gpu and not _nightshift_can_run(self, args, kwargs):
            _nightshift_fallback(region)
            return original(self, *args, **kwargs)
        if _nightshift_recording:
            return _nightshift_record(self, region, tuned, args, kwargs)
        try:
            return tuned(self, *args, **kwargs)
        except NotImplementedError as e:  # a call it was not verified on (an argument's value), refused
            _nightshift_unverified(region, e)
            return original(self, *args, **kwargs)

    forward.__nightshift_original__ = original
    forward.__nightshift_region__ = region
    forward.__doc__ = f"nightshift: {cls.__qualname__}.forward routed through {tuned.__name__}"
    cls.forward = forward


def _nightshift_find(namespace, region, qualname):
    """The class to route: from the model's globals, or from the module it is defined in."""
    owner = MODULES.get(region)
    if owner is None:
        head, *rest = qualname.split(".")
        cls = namespace.get(head)
    else:
        try:
            cls = _nightshift_importlib.import_module(owner)
        except ImportError as e:
            _nightshift_warnings.warn(f"nightshift: cannot import {owner} ({e}); {region} not routed", stacklevel=3)
            return None
        rest = qualname.split(".")
    for part in rest:
        cls = getattr(cls, part, None)
    if not isinstance(cls, type):
        where = f"module {owner}" if owner else "the model"
        _nightshift_warnings.warn(f"nightshift: no class {qualname} in {where}; {region} not routed", stacklevel=3)
        return None
    return cls


def install(namespace: dict) -> list[str]:
    """Route every region class through its tuned forward (classes of the model file are
    looked up in `namespace`, the model module's globals); returns the routed class names.
    NIGHTSHIFT_DISABLE=1 routes nothing."""
    if _nightshift_os.environ.get("NIGHTSHIFT_DISABLE", "").strip() not in ("", "0"):
        return []
    routed = []
    for region, qualname in CLASSES.items():
        cls = _nightshift_find(namespace, region, qualname)
        if cls is not None:
            _nightshift_route(cls, region, REGIONS[region])
            routed.append(qualname)
    return routed


def compile_model(model, *example_args, mode=None, options=None, **example_kwargs):
    """torch.compile(model, mode=..., options=...) with each tuned region an opaque custom op, so
    the compiler fuses everything around our kernels and (reduce-overhead) captures CUDA graphs
    over them. One eager call on the example inputs first shows each op what it is given (it
    runs the model: inputs it writes into, a KV cache, are written). A call a region runs no
    kernel of ours for (a shape its winner leaves to the original) runs the original, compiled
    with the rest. Where an op writes into its inputs or a region picks its kernel by shape, the
    model compiles with static shapes (see _nightshift_compile_kwargs): one graph per input
    shape and per int argument's value, so a server whose cache length grows call by call
    recompiles until torch.compile's recompile limit, then runs eager. A region integration found
    no faster than torch.compile of it on some shapes (UNDER_COMPILE) runs its own code there."""
    _nightshift_recording.append(True)
    try:
        with _nightshift_torch.no_grad():
            model(*example_args, **example_kwargs)
    finally:
        _nightshift_recording.clear()
    how = _nightshift_compile_kwargs(per_shape=bool(KERNEL_CHECKS) or any("*" not in v for v in UNDER_COMPILE.values()))
    return _nightshift_torch.compile(model, mode=mode, options=options, **how)
'''
