"""Freezing problems: real inputs and today's outputs of chosen regions, written to disk (the
whole model's end-to-end reference, which integration checks against: tools/capture_model.py).

For each chosen module class, the first instance in the model is the representative (path
"" is the model itself): a forward hook records the inputs of its first call in every
workload, exactly as called, and the outputs the current code gives for them
(`tools.recording`), after checking that they fit in memory (`tools.footprint`). The region
is then rebuilt on its own from the model file and its frozen state and must reproduce those
outputs; a region that does not (it depends on state outside itself, or on an argument that
is not plain data) is skipped with the reason, since no candidate could be judged on it.

Everything but that check is best-effort: the roofline floor, the FLOP count and the traced
graph facts (`tools.graph`) that could not be computed are left out with a note in
`Problem.notes`, never a traceback.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from tools import roofline
from tools.fingerprint import instance_fingerprint
from tools.fixed_answer import FIXED_INTS_NOTE, fresh_draws, rewrites_reason, rewrites_when_moved
from tools.footprint import Admission, DoesNotFit
from tools.graph import region_facts, signature_facts
from tools.inplace import inplace_paths
from tools.objects import as_called
from tools.modelfile import LoadedModel, file_sha256, host_copy, inplace_names, tensors_in
from tools.problem import Problem, StopRule, TensorSpec, Tolerance, Workload, default_tolerance, tensor_hash
from tools.recording import record_calls
from tools.sources import called_sources
from tools.region import (CALL_SEED, build_region, call_args, draws_random, flatten, module_state,
                          scalar_attributes, seeded_rng, tensor_attributes)
from tools.verify import diff


@dataclass
class RegionChoice:
    """A class picked from the profile, with what the profile knows about it."""

    class_name: str
    share: float = 0.0
    top_kernels: tuple[str, ...] = ()
    baseline_ms: dict[str, float] | None = None


@dataclass
class Skipped:
    class_name: str
    reason: str


def instances_of(model: torch.nn.Module, class_name: str) -> list[str]:
    return [p for p, m in model.named_modules() if type(m).__qualname__ == class_name]


def _floor_ms(region: torch.nn.Module, input_set: dict, outputs: list, device: torch.device,
              ceilings: dict | None, notes: list[str] | None = None) -> float | None:
    """Lower bound for one call (tools/roofline.py): what its ops touched of each input and weight,
    its outputs written once, FLOPs at peak. Where FLOPs cannot be counted the floor is the
    traffic alone, still a lower bound; None when even that fails."""
    if not ceilings:
        return 0.0
    notes = notes if notes is not None else []
    try:
        args, kwargs = call_args(input_set, device)
        tracked = [*tensors_in(args), *tensors_in(kwargs), *region.parameters(), *region.buffers()]
        moved, flops = roofline.measure(lambda: as_called(type(region).forward)(region, *args, **kwargs),
                                        tracked, notes)  # as the sandbox calls it: no hooks
        if moved is None:  # every input and weight whole, each storage once (a tied weight is read once)
            moved = sum(dict(s for t in tracked if (s := roofline.storage(t))).values())
        moved += sum(t.numel() * t.element_size() for t in outputs if t is not None)
    except Exception as e:
        notes.append(f"roofline floor: unknown ({type(e).__name__}: {str(e)[:120]})")
        return None
    traffic_ms = moved / (ceilings["bandwidth_gbps"] * 1e9) * 1e3
    if flops is None:
        return traffic_ms
    return max(traffic_ms, flops / (ceilings["matmul_tflops"] * 1e12) * 1e3)


def _unusual_layout(tensors: list) -> str | None:
    """`nested` or the layout (sparse_coo, ...) of the first tensor that is not plain strided."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and (t.is_nested or t.layout != torch.strided):
            return "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
    return None


def _abs_max(t: torch.Tensor) -> float:
    """max |t| without a temporary of t's size (complex: the largest modulus)."""
    if t.is_complex():
        return float(t.detach().abs().max())
    lo, hi = torch.aminmax(t.detach())
    return max(abs(float(lo)), abs(float(hi)))


def _facts(region: torch.nn.Module, input_set: dict, structure: str, device: torch.device) -> tuple[dict, list[str]]:
    try:
        return region_facts(region, input_set, structure, device)
    except Exception as e:  # facts help planners; they never cost the problem
        return {}, [f"graph facts: unknown ({type(e).__name__}: {str(e)[:160]})"]


def freeze(loaded: LoadedModel, choices: list[RegionChoice], folder: Path, device: torch.device, *,
           tolerance: Tolerance | None = None, per_region: dict[str, Tolerance] | None = None,
           stop_rule: StopRule | None = None, targets: list[str] | None = None, device_name: str = "",
           ceilings: dict | None = None) -> tuple[list[Problem], list[Skipped]]:
    """Write one problem folder per choice under `folder`; returns (problems, skipped).
    Nothing is written for a region that is skipped; every skip says why."""
    problems, skipped = [], []
    per_region = per_region or {}
    model_hash = file_sha256(loaded.path)
    for choice in choices:
        # A region that cannot be frozen (an op its tensors do not support, a nested tensor torch's
        # fast path made) is skipped with the reason; the others and the run go on.
        try:
            got = _freeze_one(loaded, choice, folder, device, [p.name for p in problems], model_hash, tolerance=tolerance,
                              per_region=per_region, stop_rule=stop_rule, targets=targets, device_name=device_name,
                              ceilings=ceilings)
        except Exception as e:
            got = Skipped(choice.class_name, f"could not be frozen: {type(e).__name__}: {str(e)[:300]}")
        (skipped if isinstance(got, Skipped) else problems).append(got)
    return problems, skipped


def _freeze_one(loaded: LoadedModel, choice: RegionChoice, folder: Path, device: torch.device, taken: list[str],
                model_hash: str, *, tolerance: Tolerance | None, per_region: dict[str, Tolerance],
                stop_rule: StopRule | None, targets: list[str] | None, device_name: str,
                ceilings: dict | None) -> "Problem | Skipped":
    """One choice's problem, written under `folder`, or why it is skipped (nothing written)."""
    paths = instances_of(loaded.model, choice.class_name)
    if not paths:
        return Skipped(choice.class_name, "no module of this class in the model")
    kinds = sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in map(loaded.model.get_submodule, paths)})
    if len(kinds) > 1:  # a winner is routed by class name: it would replace both classes' forwards
        return Skipped(choice.class_name, f"several classes have this name ({', '.join(kinds[:3])})")
    rep = paths[0]
    module = loaded.model.get_submodule(rep)
    if isinstance(module, torch.jit.ScriptModule):
        return Skipped(choice.class_name, "a TorchScript module (torch.jit.script or trace): its calls cannot be "
                       "recorded, and a candidate cannot replace its forward")
    state = module_state(module)
    admission = Admission(device, sum(t.numel() * t.element_size() for t in state.values()),
                          copies=device.type != "cpu")
    try:
        names = [p["name"] for p in signature_facts(type(module))]
        inputs, raw_outputs, calls, notes = record_calls(loaded.model, module, loaded.workloads, names, admission)
    except DoesNotFit as e:
        return Skipped(choice.class_name, f"does not fit in memory: {e}")
    except RuntimeError as e:
        return Skipped(choice.class_name, f"{rep or 'the model'}: {e}")
    if odd := _unusual_layout([t for s in inputs for t in tensors_in(s)] + [t for o in raw_outputs for t in flatten(o)[0]]):
        return Skipped(choice.class_name, f"takes or returns {odd} tensors (torch's fast paths make nested ones from "
                       "padding masks): only strided tensors can be frozen and compared")
    absent = [n for n in notes if "absent" in n]
    if any(n.startswith("output") for n in absent):
        return Skipped(choice.class_name, f"returns something that is not plain data ({absent[0]})")
    flat = [flatten(o) for o in raw_outputs]
    if not any(isinstance(t, torch.Tensor) and t.numel() for t in flat[0][0]):
        return Skipped(choice.class_name, "returns no tensor to compare")
    reference = [{"structure": s, "outputs": outs} for outs, s in flat]
    why_absent = f" (frozen as absent: {'; '.join(absent)[:300]})" if absent else ""
    # The region alone, rebuilt from the file and the frozen state, must give the same outputs.
    try:
        alone = build_region(loaded.path, rep, state, device)
        versions = _versions(alone)
        with torch.no_grad():
            # forward itself, as the sandbox calls it: the model's hooks on the module stay outside
            own = as_called(type(alone).forward)
            again, random = draws_random(lambda: [flatten(own(alone, *call_args(s, device)[0], **call_args(s, device)[1]))[0]
                                                  for s in inputs], device)
            if random:  # no fixed answer: today's outputs are the seeded calls' (`CALL_SEED`),
                # and the check below is a second seeded run against them: seeded, it must agree.
                flat = [([host_copy(t) if isinstance(t, torch.Tensor) else t for t in outs], structure)
                        for outs, (_, structure) in zip(_seeded_calls(alone, inputs, device), flat)]
                reference = [{"structure": st, "outputs": outs} for outs, st in flat]
                again = _seeded_calls(alone, inputs, device)
                notes.append(f"draws random numbers in its forward: every call of it (the original's and each "
                             f"candidate's) starts from torch.manual_seed({CALL_SEED})")
    except Exception as e:
        return Skipped(choice.class_name, f"cannot be rebuilt on its own: {type(e).__name__}: "
                               f"{str(e)[:300]}{why_absent}")
    # The tolerance follows the first floating-point output; with none (argmax's indices), exact.
    tensors = [t for t in flat[0][0] if isinstance(t, torch.Tensor) and t.numel()]
    first = next((t for t in tensors if t.is_floating_point() or t.is_complex()), tensors[0])
    ref_max = max((_abs_max(t) for outs, _ in flat for t in outs if isinstance(t, torch.Tensor)
                   and (t.is_floating_point() or t.is_complex()) and t.numel()), default=0.0)
    tol, source = default_tolerance(first.dtype, ref_max), "default"
    if tolerance is not None:
        tol, source = tolerance, "cli"
    if choice.class_name in per_region:
        tol, source = per_region[choice.class_name], "cli (per region)"
    # Compared where the rebuilt outputs are: the references go to the device, so the host
    # never holds a second copy of the outputs.
    drift = max(diff(a, [r if r is None or t is None else r.to(t.device) for r, t in zip(ref["outputs"], a)]
                     ).error(tol) for a, ref in zip(again, reference))
    del again
    if drift > tol.value:
        held = tensor_attributes(module)
        why = (f"it holds tensors that are neither parameters nor buffers ({', '.join(held[:3])}), which its "
               "forward may change between calls" if held else "it depends on state outside the module")
        return Skipped(choice.class_name, f"rebuilt on its own it differs from the captured outputs "
                               f"by {drift:.3g} (> {tol}): {why}{why_absent}")
    written = [n for n, v in _versions(alone).items() if versions.get(n, v) != v]
    if written and (moved := _answer_moved(alone, inputs[0], reference[0], tol, random, device)):
        return Skipped(choice.class_name, f"its forward changes its own parameters or buffers "
                               f"({', '.join(written[:3])}) and then answers otherwise (by {moved:.3g} on a "
                               "second call): it has no fixed answer to judge a candidate by")
    fixed_ints, why = fresh_draws(lambda *a, **k: own(alone, *a, **k), inputs[0], device, random)
    if why:
        return Skipped(choice.class_name, f"its own forward raises on fresh inputs drawn from the frozen ones ({why})")
    if rewritten := rewrites_when_moved(alone, lambda m, a, k: as_called(type(m).forward)(m, *a, **k), inputs[0], device,
                                        random, fixed_ints):
        return Skipped(choice.class_name, rewrites_reason("its forward", rewritten))
    if fixed_ints:
        notes.append(FIXED_INTS_NOTE)
    if kinds := _train_only(loaded, module):
        notes.append(_eval_note(kinds))
    constant = _constant([t for outs, _ in flat for t in outs])
    if constant is not None:
        notes.append(f"every output element is {constant:g} on every frozen input set: a candidate may return "
                     "that without computing; its trials are flagged")
    graph, graph_notes = _facts(alone, inputs[0], flat[0][1], device)
    notes += graph_notes + [n for n in [admission.note()] if n]
    workloads = []
    for w, s, (outs, _) in zip(loaded.workloads, inputs, flat):
        workloads.append(Workload(
            name=w.name, weight=w.weight, calls_per_forward=calls[w.name],
            inputs=[TensorSpec.of(f"in{i}", t) for i, t in enumerate(tensors_in(s))],
            outputs=[TensorSpec.of(f"out{i}", t) for i, t in enumerate(outs) if t is not None],
            baseline_ms=(choice.baseline_ms or {}).get(w.name)))
    floors = {w.name: _floor_ms(alone, s, outs, device, ceilings, notes)
              for w, s, (outs, _) in zip(loaded.workloads, inputs, flat)}
    name = _folder_name(choice.class_name, taken, folder)
    problem = Problem(
        name=name, region_class=choice.class_name, region_path=rep, instances=paths,
        fingerprints={path: instance_fingerprint(loaded.model.get_submodule(path)) for path in paths},
        region_source=_source(type(module)), called_sources=called_sources(module),
        model_file=str(loaded.path), model_hash=model_hash,
        init_hash=tensor_hash(loaded.init_inputs), device=device.type, device_name=device_name,
        parameters=[TensorSpec.of(n, t) for n, t in state.items()], model_bytes=model_bytes(loaded.model),
        attributes=scalar_attributes(module), children={n: type(c).__qualname__ for n, c in module.named_children()},
        workloads=workloads, tolerance=tol, tolerance_source=source,
        metric="weighted_latency" if len(workloads) > 1 else "latency",
        target_generations=list(targets or []), stop_rule=stop_rule or StopRule(),
        share_of_model=choice.share, top_kernels=list(choice.top_kernels), model_env=dict(loaded.env),
        floor_ms={k: v for k, v in floors.items() if v is not None}, graph=graph, notes=_unique(notes),
        inplace_inputs=inplace_paths(names, set(inplace_names(type(module))), inputs[0]), seeded_calls=random,
        fixed_ints=fixed_ints,
        constant_output=constant)
    problem.save(folder / name, inputs, reference, state)
    del inputs, raw_outputs, reference, flat, alone
    return problem


def _seeded_calls(region: torch.nn.Module, inputs: list[dict], device: torch.device) -> list[list]:
    """The region's outputs on each input set, each call from torch.manual_seed(CALL_SEED)."""
    out = []
    for s in inputs:
        args, kwargs = call_args(s, device)
        with seeded_rng(device):
            out.append(flatten(as_called(type(region).forward)(region, *args, **kwargs))[0])
    return out


def _constant(outputs: list) -> float | None:
    """The one value every floating-point output element holds, if there is one (and more than
    one element to hold it), else None. NaN where every element is NaN: NaN matches NaN, so an
    answer of NaNs computed from nothing passes there as surely as a constant does."""
    floats = [t for t in outputs if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    if not floats or sum(t.numel() for t in floats) < 2:
        return None
    if all(bool(torch.isnan(t).all()) for t in floats):
        return math.nan
    ends = [float(v) for t in floats for v in torch.aminmax(t.detach().float())]
    return ends[0] if not any(math.isnan(v) for v in ends) and min(ends) == max(ends) else None


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer (tied ones once)."""
    seen = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in seen.values())


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _folder_name(class_name: str, taken: list[str], folder: Path | None = None) -> str:
    """A folder name for the class that no problem of this freeze, nor a folder already in
    `folder`, has: freezing never overwrites an existing problem."""
    base = re.sub(r"[^A-Za-z0-9_.-]", "_", class_name)
    name, i = base, 2
    while name in taken or (folder is not None and (Path(folder) / name).exists()):
        name, i = f"{base}_{i}", i + 1
    return name


def _source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return f"# source of {cls.__qualname__} not available"


def _state_written(module: torch.nn.Module, before: dict[str, torch.Tensor],
                   versions: dict[str, tuple[int, int]]) -> list[str]:
    """Parameters and buffers of `module` that differ from `before` (its state before its calls);
    only those written since (`_versions` then) are compared, so no weight leaves the device."""
    now = dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers(remove_duplicate=False))
    since = _versions(module)
    return [n for n, t in now.items() if n in before and since.get(n) != versions.get(n) and not (
        t.shape == before[n].shape and torch.equal(t.detach().cpu(), before[n]))]


def _versions(module: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Each parameter and buffer: (the tensor's identity, its count of in-place writes)."""
    out = {}
    for n, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        try:
            out[n] = (id(t), t._version)
        except RuntimeError:  # an inference tensor counts no writes
            pass
    return out


def _answer_moved(region: torch.nn.Module, input_set: dict, reference: dict, tol: Tolerance, seeded: bool,
                  device: torch.device) -> float:
    """How far a further call on the first input set lands from its frozen answer, where that is
    beyond the tolerance (0 where not): a cache rebuilt alike is state written, not an answer moved."""
    args, kwargs = call_args(input_set, device)
    with torch.no_grad(), (seeded_rng(device) if seeded else contextlib.nullcontext()):
        outs = flatten(as_called(type(region).forward)(region, *args, **kwargs))[0]
    refs = [r if r is None or t is None else r.to(t.device) for r, t in zip(reference["outputs"], outs)]
    error = diff(outs, refs).error(tol)
    return error if error > tol.value else 0.0


def _train_only(loaded: LoadedModel, module: torch.nn.Module) -> list[str]:
    """Which of the model's train-only behaviours (loaded.train_only) this module holds."""
    held = {type(m).__name__ for m in module.modules()}
    return [k for k in getattr(loaded, "train_only", []) if k in held]


def _eval_note(kinds: list[str]) -> str:
    return (f"frozen in eval mode (model.eval(): nightshift tunes inference): its {', '.join(kinds)} run as in "
            "inference, and a candidate is judged against those outputs")
