"""The frozen problem: one region of a model to speed up, fixed before the first trial.

A problem folder `runs/<run>/problems/<region>/` holds:

- `problem.json`  this module's `Problem`, pydantic-validated;
- `inputs.pt`     one input set per workload: {"args": [...], "kwargs": {...}};
- `reference.pt`  the outputs today's code gives for each input set;
- `state.pt`      the representative module's parameters and buffers.

Every tensor file is recorded with a content hash, so a changed file is caught on load.
"""

from __future__ import annotations

import errno
import hashlib
import math
import os
import shutil
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from tools import seal, strict_json

PROBLEM_FILE = "problem.json"
INPUTS_FILE = "inputs.pt"
REFERENCE_FILE = "reference.pt"
STATE_FILE = "state.pt"


FULL_BELOW = 1 << 20
"""Free bytes under which a run's disk counts as full."""


def free_bytes(folder: Path) -> int | None:
    """Bytes an unprivileged writer may still use on the file system holding `folder`."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


class ProblemError(ValueError):
    """A problem folder is missing, malformed, or no longer matches its hashes."""


def _finite_non_negative(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite, non-negative number, got {value!r}")
    return value


class Tolerance(BaseModel):
    """How far a candidate's outputs may be from the frozen reference outputs."""

    kind: Literal["abs", "rel"] = "abs"
    """`abs`: max |out - ref| <= value. `rel`: max |out - ref| / max |ref| <= value, for
    outputs whose values span a wide range."""
    value: float
    """The bound itself."""

    @field_validator("value")
    @classmethod
    def _check_value(cls, v: float) -> float:
        return _finite_non_negative("tolerance", v)

    def error(self, max_abs: float, ref_max: float) -> float:
        """The number compared with `value` for this tolerance kind."""
        if self.kind == "abs":
            return max_abs
        return max_abs / ref_max if ref_max > 0 else (0.0 if max_abs == 0 else math.inf)

    def __str__(self) -> str:
        return f"{self.kind} {self.value:g}"

    @classmethod
    def parse(cls, text: str) -> "Tolerance":
        """Parse `abs:1e-3`, `rel:1e-2` or a bare number (abs)."""
        kind, _, value = text.partition(":") if ":" in text else ("abs", "", text)
        try:
            return cls(kind=kind.strip(), value=float(value))
        except (ValueError, TypeError) as e:
            raise ValueError(f"bad tolerance {text!r}: use abs:VALUE or rel:VALUE ({e})") from None


# Defaults by output dtype, written into problem.json at freeze time. bf16 has 8 bits of
# mantissa, so two correct fp32-accumulating kernels often differ by an ulp of the output.
DEFAULT_TOLERANCE: dict[str, dict[str, float]] = {
    "float32": {"abs": 1e-4, "rel": 1e-5},
    "float64": {"abs": 1e-9, "rel": 1e-10},
    "float16": {"abs": 1e-2, "rel": 2e-3},
    "bfloat16": {"abs": 2e-2, "rel": 1e-2},
}
# Above this magnitude of the reference an absolute bound stops meaning much.
WIDE_RANGE = 8.0
DIRECT_BUILD_BYTES = 256 << 20


def default_tolerance(dtype: torch.dtype, ref_max: float) -> Tolerance:
    """The tolerance written down for an output of `dtype` whose largest |value| is ref_max.

    Never tighter than two rounding steps of the dtype at the output's largest magnitude:
    two correct kernels that sum in a different order may round one element differently,
    and that must not fail them."""
    import torch  # here, not at the top: the CLI reads problems (status, report) without torch
    if not (dtype.is_floating_point or dtype.is_complex):
        return Tolerance(kind="abs", value=0.0)  # indices, counts, masks: exactly, or wrong
    name = {"complex64": "float32", "complex128": "float64"}.get(str(dtype).removeprefix("torch."),
                                                               str(dtype).removeprefix("torch."))
    table = DEFAULT_TOLERANCE.get(name, DEFAULT_TOLERANCE["float32"])
    if ref_max > WIDE_RANGE:
        return Tolerance(kind="rel", value=table["rel"])
    eps = torch.finfo(dtype).eps if dtype.is_floating_point or dtype.is_complex else 0.0
    step = eps * 2.0 ** math.floor(math.log2(ref_max)) if ref_max > 0 else 0.0
    return Tolerance(kind="abs", value=max(table["abs"], 2 * step))


class StopRule(BaseModel):
    """When the search over a run stops. All caps are finite and non-negative."""

    gpu_hours: float = 0.25
    """Cap on device time summed over all devices, in hours (the CPU counts as a device)."""
    max_candidates: int = 200
    """Cap on the number of candidates tried over the whole run."""
    patience: int = 40
    """Stop a region after this many consecutive passing trials bring no improvement."""
    max_usd: float | None = None
    """Cap on dollars spent on LLM calls (LLM planners only)."""

    @field_validator("gpu_hours", "max_usd")
    @classmethod
    def _finite(cls, v: float | None, info) -> float | None:
        return _finite_non_negative(info.field_name, v)

    @field_validator("max_candidates", "patience")
    @classmethod
    def _non_negative_int(cls, v: int, info) -> int:
        if v < 0:
            raise ValueError(f"{info.field_name} must be non-negative, got {v}")
        return v


class TensorSpec(BaseModel):
    """Shape, dtype and stride of one tensor (an input, output, parameter or buffer)."""

    name: str
    shape: list[int]
    dtype: str
    stride: list[int] | None = None

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> "TensorSpec":
        return cls(name=name, shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."),
                   stride=list(t.stride()))

    @property
    def nbytes(self) -> int:
        import torch
        return math.prod(self.shape) * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


class Workload(BaseModel):
    """One named input set of the model and its weight in the metric."""

    name: str
    weight: float = 1.0
    inputs: list[TensorSpec] = Field(default_factory=list)
    """The region's inputs under this workload (flattened args then kwargs)."""
    outputs: list[TensorSpec] = Field(default_factory=list)
    calls_per_forward: int = 1
    """How often the region runs in one forward pass of the model under this workload."""
    baseline_ms: float | None = None
    """Device time of the region at freeze time (from the profile), per call."""
    tolerance: Tolerance | None = None
    """This workload's own tolerance (the whole model: calibrated per workload); None: the problem's."""
    tolerance_source: str = ""

    @field_validator("weight")
    @classmethod
    def _w(cls, v: float) -> float:
        return _finite_non_negative("workload weight", v)


class Problem(BaseModel):
    """One region to speed up, frozen before trial 1."""

    name: str
    """Folder name, e.g. `LlamaMLP`."""
    region_class: str
    """Qualified name of the module class whose forward a candidate replaces."""
    region_path: str
    """Module path of the representative instance whose inputs and state were captured."""
    instances: list[str] = Field(default_factory=list)
    """Every module path of this class in the model (all are routed through the winner)."""
    fingerprints: dict[str, str] = Field(default_factory=dict)
    """Instance path -> what a winner may specialise on in it (tools/fingerprint.py); `agent apply`
    routes only instances whose digest was verified. Empty in runs frozen before it existed."""
    region_source: str
    """Source of the class, so planners and reviewers see what is being replaced."""
    called_sources: dict[str, str] = Field(default_factory=dict)
    """Source of the code the region's forward reaches beyond its class, by name: the classes of
    its submodules at any depth (a built one it never calls too) and the module-level functions
    its code calls (torch's and Python's own left out: `children` names those modules). With
    `region_source`, the whole math."""
    model_file: str
    model_hash: str
    init_hash: str = ""
    """Hash of the model's init inputs, as captured."""
    device: str
    """Device the reference outputs were computed on (`cuda`, `cpu`)."""
    device_name: str = ""
    parameters: list[TensorSpec] = Field(default_factory=list)
    """Parameters and buffers of the representative module, by dotted name."""
    model_bytes: int | None = None
    """The whole model's parameters and buffers at freeze: below DIRECT_BUILD_BYTES the sandbox
    rebuilds it directly, above (or unknown) on the meta device, where arithmetic in a module's
    __init__ runs torch's Python decompositions, which import torch._dynamo (seconds of each
    worker's start)."""
    attributes: dict[str, float | int | bool | str] = Field(default_factory=dict)
    """Scalar attributes of the representative module (eps, num_heads, ...), for planners."""
    children: dict[str, str] = Field(default_factory=dict)
    """Direct child modules: name -> class name."""
    workloads: list[Workload]
    tolerance: Tolerance
    tolerance_source: str = "default"
    """Where the tolerance came from: `default` (by dtype), `cli`, `problem`."""
    metric: Literal["latency", "weighted_latency"] = "latency"
    target_generations: list[str] = Field(default_factory=list)
    """Hardware generations a candidate must pass on, e.g. ['sm90']. Empty: the freeze device."""
    stop_rule: StopRule = Field(default_factory=StopRule)
    share_of_model: float = 0.0
    """Fraction of the model's device time spent in this region (from the profile)."""
    top_kernels: list[str] = Field(default_factory=list)
    floor_ms: dict[str, float] = Field(default_factory=dict)
    """Per workload: a lower bound on one call's time from bytes moved and FLOPs done."""
    hashes: dict[str, str] = Field(default_factory=dict)
    """sha256 of inputs.pt, reference.pt and state.pt."""
    inplace_inputs: list[str] = Field(default_factory=list)
    """Declared in-place outputs (a KV cache): where they are in an input set, "args.1" or
    "kwargs.k_cache" (tools/inplace.py). The verifier compares them with the original's."""
    constant_output: float | None = None
    """Every floating-point output element on every frozen input set is this one value (a
    min then a clamp leaves only zeros): a candidate may return it without computing anything,
    correctly here, so its speedup says nothing of a kernel; such trials are flagged."""
    seeded_calls: bool = False
    """The region draws random numbers in its forward: every call of it, the original's and a
    candidate's, starts from torch.manual_seed(tools.region.CALL_SEED)."""
    fixed_ints: bool = False
    """Fresh input draws keep the integer tensors as frozen (floats still move): rolled, the
    original itself raised on them (EmbeddingBag's offsets must start at 0 and rise)."""
    model_env: dict[str, str] = Field(default_factory=dict)
    """Environment variables the model file read when it was frozen (LLAMA_PRESET, ...): the
    sandbox workers get exactly these, so they build the same model."""
    # -- written by tools.capture; best-effort facts for planners, never read by the verifier
    graph: dict[str, Any] = Field(default_factory=dict)
    """What tools.graph found about the region: its signature, arguments, matmuls, RoPE tables, mask."""
    notes: list[str] = Field(default_factory=list)
    """Analyses that could not be done at freeze time (FLOP count, trace, ...) and arguments frozen as absent."""

    @model_validator(mode="after")
    def _weights(self) -> "Problem":
        if not self.workloads:
            raise ValueError("a problem needs at least one workload")
        if sum(w.weight for w in self.workloads) <= 0:
            raise ValueError("workload weights must not all be zero")
        return self

    # -- files ---------------------------------------------------------------------------
    def save(self, folder: Path, inputs: list[dict], reference: list[Any], state: dict,
             seal_root: Path | None = None) -> None:
        """Write the problem folder and seal every file of it in the run's seal (tools/seal.py):
        the run folder is the problem folder's grandparent (`runs/<run>/problems/<name>`), or
        `seal_root` (the whole model's `runs/<run>/model/` is sealed in its parent)."""
        import torch
        folder.mkdir(parents=True, exist_ok=True)
        for fname, obj in ((INPUTS_FILE, inputs), (REFERENCE_FILE, reference), (STATE_FILE, state)):
            try:
                torch.save(obj, folder / fname)
            except RuntimeError:  # torch's writer says "unexpected pos" where the disk is full
                if (free := free_bytes(folder)) is None or free >= FULL_BELOW:
                    raise
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder / fname)) from None
            self.hashes[fname] = file_hash(folder / fname)
        tmp = folder / (PROBLEM_FILE + ".tmp")
        tmp.write_text(strict_json.dumps(self, indent=2))  # an all-NaN output's constant: "NaN"
        tmp.replace(folder / PROBLEM_FILE)
        seal.record(seal_root or folder.parent.parent,
                    [folder / f for f in (PROBLEM_FILE, INPUTS_FILE, REFERENCE_FILE, STATE_FILE)])

    @classmethod
    def load(cls, folder: Path) -> "Problem":
        path = Path(folder) / PROBLEM_FILE
        if not path.is_file():
            raise ProblemError(f"{folder}: no {PROBLEM_FILE} (not a problem folder)")
        try:
            seal.check(seal.root_of(Path(folder)), path)
        except seal.SealError as e:
            raise ProblemError(str(e)) from None
        try:
            return cls.model_validate_json(path.read_text())
        except ValueError as e:
            raise ProblemError(f"{path}: invalid problem: {e}") from None

    def load_tensors(self, folder: Path, inputs: bool = True, state: bool = True) -> tuple[Any, list[Any], Any]:
        """Inputs, reference outputs and module state, each checked against its hash (inputs or
        state only checked, not loaded, when not asked for: sandbox workers load those)."""
        import torch
        out = []
        for fname, want in ((INPUTS_FILE, inputs), (REFERENCE_FILE, True), (STATE_FILE, state)):
            path = Path(folder) / fname
            if not path.is_file():
                raise ProblemError(f"{path} is missing")
            if self.hashes.get(fname) != file_hash(path):
                raise ProblemError(f"{path} changed since the problem was frozen (hash mismatch)")
            out.append(torch.load(path, weights_only=True, map_location="cpu", mmap=True) if want else None)
        return out[0], out[1], out[2]

    @property
    def weights(self) -> dict[str, float]:
        total = sum(w.weight for w in self.workloads)
        return {w.name: w.weight / total for w in self.workloads}

    def tolerance_for(self, index: int) -> Tolerance:
        """The tolerance that judges input set `index` (its workload's, else the problem's)."""
        w = self.workloads[index] if 0 <= index < len(self.workloads) else None
        return w.tolerance if w is not None and w.tolerance is not None else self.tolerance

    @property
    def build_on_meta(self) -> bool:
        return self.model_bytes is None or self.model_bytes > DIRECT_BUILD_BYTES

    @property
    def is_whole_model(self) -> bool:
        return self.region_path == ""


file_hash = seal.file_hash


def tensor_hash(obj: Any) -> str:
    """Content hash of a (nested) structure of tensors: bytes, shapes and dtypes."""
    import torch
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
            h.update(f"T{tuple(t.shape)}{t.dtype}".encode())
            if t.numel():
                h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))  # no copy of the bytes
        elif isinstance(x, dict):
            for k in sorted(x):
                h.update(f"K{k}".encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(f"L{len(x)}".encode())
            for v in x:
                walk(v)
        else:
            h.update(repr(x).encode())

    walk(obj)
    return h.hexdigest()
