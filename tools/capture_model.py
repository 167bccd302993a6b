"""The whole model as one more problem, for integration: its inputs and today's outputs per
workload, every parameter and buffer, and a tolerance per workload calibrated against a run in
a wider dtype. The regions' problems are frozen by tools/capture.py, whose checks this shares.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch

from tools.capture import _constant, _eval_note, _floor_ms, _source, _state_written, _train_only, _versions, model_bytes
from tools.fixed_answer import FIXED_INTS_NOTE, fresh_draws, rewrites_reason, rewrites_when_moved
from tools.inplace import inplace_paths
from tools.graph import signature_facts
from tools.modelfile import LoadedModel, WorkloadInputs, file_sha256, host_copy, inplace_names, tensors_in
from tools.recording import not_plain
from tools.problem import Problem, TensorSpec, Tolerance, Workload, default_tolerance, tensor_hash
from tools.region import draws_random, flatten, module_state, seeded_rng
from tools.verify import diff

MODEL_DIR = "model"
WHOLE_MODEL = "(whole model)"
"""The run's `skipped` key that says why the freeze made no whole-model problem."""
MODEL_PROBLEM = "model"


def freeze_model(loaded: LoadedModel, folder: Path, device: torch.device, tolerance: Tolerance | None = None,
                 device_name: str = "", model_env: dict[str, str] | None = None, ceilings: dict | None = None) -> Problem:
    """The whole model as a problem (`runs/<run>/model/`, region path ""): its inputs and today's
    outputs per workload, every parameter and buffer, and a tolerance per workload
    (`calibrated_tolerance` unless given), and with the device's `ceilings` the roofline floor per
    workload (what the report holds every way of running it to). Integration runs candidates for it (the model with
    winners routed in, torch.compile of it) through the same trial path as any region."""
    state, versions = module_state(loaded.model), _versions(loaded.model)
    if outside := [k for k in loaded.model.state_dict(keep_vars=True) if k not in state]:
        raise ValueError(f"the model keeps state outside its parameters and buffers ({', '.join(outside[:3])}; "
                         "quantized weights, for one): the sandbox rebuilds it from those alone, and it would "
                         "answer otherwise there")
    inputs, reference, workloads = [], [], []
    random = False
    with torch.no_grad():
        for w in loaded.workloads:
            input_set, structure, outs, draws = _reference_outputs(loaded, w, device)
            random = random or draws  # once one workload draws, every later one is judged as random too
            tol, source = _workload_tolerance(loaded, w, outs, tolerance, random)
            if hasattr(w, "restore"):
                w.restore()
            inputs.append(input_set)
            reference.append({"structure": structure, "outputs": outs})
            workloads.append(Workload(
                name=w.name, weight=w.weight, tolerance=tol, tolerance_source=source,
                inputs=[TensorSpec.of(f"in{i}", t) for i, t in enumerate(tensors_in(input_set))],
                outputs=[TensorSpec.of(f"out{i}", t) for i, t in enumerate(outs) if t is not None]))
    model = loaded.model
    floor_notes: list[str] = []
    floors = {w.name: _floor_ms(model, s, r["outputs"], device, ceilings, floor_notes)
              for w, s, r in zip(loaded.workloads, inputs, reference)}
    fixed_ints = _fixed_answer(model, state, versions, inputs[0], device, random)
    constant = _constant([t for r in reference for t in r["outputs"]])
    problem = Problem(
        name=MODEL_PROBLEM, region_class=type(model).__qualname__, region_path="", instances=[""],
        region_source=_source(type(model)), model_file=str(loaded.path), model_hash=file_sha256(loaded.path),
        init_hash=tensor_hash(loaded.init_inputs), device=device.type, device_name=device_name,
        children={n: type(c).__qualname__ for n, c in model.named_children()}, workloads=workloads,
        model_bytes=model_bytes(model),
        tolerance=workloads[0].tolerance, tolerance_source="per workload (end to end)",
        metric="weighted_latency" if len(workloads) > 1 else "latency", share_of_model=1.0,
        inplace_inputs=inplace_paths([p["name"] for p in signature_facts(type(model))],
                                     set(inplace_names(type(model))), inputs[0]), seeded_calls=random,
        fixed_ints=fixed_ints, constant_output=constant, floor_ms={k: v for k, v in floors.items() if v},
        model_env=dict(model_env if model_env is not None else getattr(loaded, "env", {}) or {}),
        notes=([_eval_note(kinds)] if (kinds := _train_only(loaded, model)) else []) + ([FIXED_INTS_NOTE] if fixed_ints else [])
               + ([f"every output element is {constant:g} on every workload: a candidate may return that without "
                   "computing; its trials are flagged"] if constant is not None else []) + list(dict.fromkeys(floor_notes)))
    problem.save(Path(folder), inputs, reference, state, seal_root=Path(folder).parent)
    return problem


def _reference_outputs(loaded: LoadedModel, w: WorkloadInputs, device: torch.device) -> tuple[dict, str, list, bool]:
    """One workload's inputs as frozen, the structure of the model's answer and its outputs on the
    host, and whether the model drew random numbers (then its answer is the seeded call's)."""
    if hasattr(w, "restore"):
        w.restore()  # a KV cache starts as the workload made it, not as the last forward left it
    if odd := not_plain(list(w.inputs), "input"):  # the sandbox loads frozen inputs as plain data only
        raise ValueError(f"the model takes what cannot be frozen as plain data ({odd} on {w.name!r}; tensors, "
                         "numbers, strings and lists, tuples and dicts of them can be)")
    input_set = {"args": host_copy(list(w.inputs)), "kwargs": {}}
    out, draws = draws_random(lambda: loaded.model(*w.inputs), device)
    if draws:  # no fixed answer: the model's calls are seeded, here and in every worker
        if hasattr(w, "restore"):
            w.restore()
        with seeded_rng(device):
            out = loaded.model(*w.inputs)
    leaves, structure = flatten(out)
    del out
    if structure.startswith("?") or "?" in structure:
        raise ValueError(f"the model returns something other than tensors ({structure}) on {w.name!r}")
    return input_set, structure, [host_copy(t) for t in leaves], draws


def _workload_tolerance(loaded: LoadedModel, w: WorkloadInputs, outs: list, tolerance: Tolerance | None,
                        random: bool) -> tuple[Tolerance, str]:
    """The tolerance of one workload's outputs and where it came from: given, the default where a
    calibration cannot be trusted, else `calibrated_tolerance`."""
    tensors = [t for t in outs if isinstance(t, torch.Tensor) and t.numel()]
    floats = [t for t in tensors if t.is_floating_point() or t.is_complex()]
    if not tensors:
        raise ValueError(f"the model returns no tensor to compare on {w.name!r}")
    ref_max = max((float(t.abs().max()) for t in floats), default=0.0)
    if tolerance is not None:
        return tolerance, "cli"
    if not floats:
        return default_tolerance(tensors[0].dtype, 0.0), "default (integer outputs: exact)"
    if random:  # a wider dtype draws other numbers: no calibration against it
        return default_tolerance(floats[0].dtype, ref_max), "default (the model draws random numbers)"
    if any(t.is_complex() for t in floats):  # the wide run's casts would drop imaginary parts
        return default_tolerance(floats[0].dtype, ref_max), "default (complex outputs)"
    return calibrated_tolerance(loaded.model, list(w.inputs), outs, floats[0].dtype, ref_max)


def _fixed_answer(model: torch.nn.Module, state: dict, versions: dict, first_inputs: dict, device: torch.device,
                  random: bool) -> bool:
    """The model's fixed integer inputs (tools/fixed_answer.py), once it is known to answer the
    same from the same state on fresh inputs, wherever they live; a ValueError where it does not."""
    if written := _state_written(model, state, versions):  # the sandbox refuses a trial that writes them too
        raise ValueError(f"the model changes its own parameters or buffers in its forward ({', '.join(written[:3])}): "
                         "every call starts from another state, so it has no fixed answer to compare with")
    fixed_ints, why = fresh_draws(model, first_inputs, device, random)
    if why:
        raise ValueError(f"the model raises on fresh inputs drawn from the frozen ones ({why})")
    if rewritten := rewrites_when_moved(model, lambda m, a, k: m(*a, **k), first_inputs, device, random, fixed_ints):
        raise ValueError(rewrites_reason("the model", rewritten))
    return fixed_ints


def calibrated_tolerance(model: torch.nn.Module, inputs: list, outputs: list, dtype: torch.dtype,
                         ref_max: float) -> tuple[Tolerance, str]:
    """The end-to-end tolerance for one workload, written down before the first trial.

    Errors compound over layers: a model's output is already some rounding steps away from
    the exact answer, and a correct rewrite lands some steps away on its own. So the model
    is run once more in a wider dtype (float32 for 16-bit models, float64 for float32) and
    today's own error against that is measured; a tuned model may differ from today's output
    by twice that (each of the two within today's error of the exact answer), and never by
    less than two rounding steps. Where the wide run is impossible, the default stands."""
    floor = default_tolerance(dtype, ref_max)
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else torch.float64
    try:
        exact_model = copy.deepcopy(model).to(wide)
        cast = [x.to(wide) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs]
        with torch.no_grad():
            leaves, _ = flatten(exact_model(*cast))
        exact = [t.detach().to("cpu", wide) if isinstance(t, torch.Tensor) else None for t in leaves]
        del exact_model
        own = diff([t.to(wide) if isinstance(t, torch.Tensor) else None for t in outputs], exact)
    except Exception as e:  # a model that cannot run wide (fixed dtypes inside, memory): the default
        return floor, f"default (no calibration: {type(e).__name__}: {str(e)[:80]})"
    error = floor.error(own.max_abs, ref_max)  # absolute, or relative for wide-ranging outputs
    if own.bad_nonfinite or not math.isfinite(error):
        return floor, "default (no calibration: the wide run is not finite)"
    value, against = float(f"{2 * error:.3g}"), str(wide).removeprefix("torch.")
    if value <= floor.value:
        return floor, f"calibrated: two rounding steps exceed twice today's error vs {against} ({error:.3g})"
    return Tolerance(kind=floor.kind, value=value), f"calibrated: twice today's error vs {against} ({error:.3g})"
