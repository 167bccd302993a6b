"""Profile a model and attribute its device time to the module tree.

Every module's forward is wrapped (pre/post hooks) in a profiler range `ns::<path>::<Class>`,
and every workload's forwards in `nsw::<workload>`. Time is then attributed as follows:

- GPU: the profiler links each device kernel (and memcpy/memset) to the CPU op that launched
  it through the CUDA/HIP correlation id, and lists it in that op's `kernels`. We walk the
  launching op's `cpu_parent` chain up to the innermost `ns::` range. This uses the launch
  site, not device timestamps, so it stays right while the GPU runs behind the CPU (async
  launches, several streams), where matching device times against CPU ranges would not.
- CPU: there are no kernels; a "kernel" is each aten op a module's own code calls (the op
  directly under an `ns::` range), timed by its total CPU time. Leaf ops would miss the
  work inside composite ops (`aten::addmm`'s own time is its GEMM), so we take the outermost
  op instead. All times are then CPU times, and every rendering says so.

Inclusive time of a region is the sum over its subtree, so a fusion opportunity across
children (residual add + norm, SiLU * mul) shows up at their parent. FLOPs and bytes come
from one extra forward under a dispatch mode (torch's FLOP formulas; bytes of every non-view
op). The roofline floor uses the region's boundary traffic (inputs + outputs + parameters):
what an ideally fused kernel would still move. Modules called via `.forward()` directly
skip hooks; their time is counted in the caller.
"""

from __future__ import annotations

import re
import statistics
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel
from rich.table import Table
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from tools.devices import Ceilings, device_info
from tools.modelfile import LoadedModel, WorkloadInputs, tensors_in

NS, NSW, ROOT = "ns::", "nsw::", ""
CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)
# Kernels a fusion does not remove: GEMMs, convolutions, attention. The rest are candidates.
HEAVY = re.compile(r"gemm|gemv|matmul|\bmm\b|addmm|bmm|linear|conv|attention|attn|flash|fmha|sdpa|"
                   r"cutlass|cublas|nvjet|xmma|wgmma", re.I)
_aten = torch.ops.aten
_FLOPS_AS = {_aten._scaled_dot_product_flash_attention_for_cpu: _aten._scaled_dot_product_flash_attention}


class KernelStat(BaseModel):
    name: str
    ms: float
    count: float


class RegionStats(BaseModel):
    """Numbers shared by module rows and class rows, all per forward of the whole model."""

    calls: float
    inclusive_ms: float
    share: float
    """inclusive_ms / the model's total."""
    kernels: float
    """Kernel launches (CPU: aten calls) inside the region."""
    top_kernels: list[KernelStat]
    small_kernels: float
    """Fusion hint: launches inside that are not GEMM/conv/attention and shorter than the
    small-kernel threshold."""
    small_kernels_ms: float
    flops: float
    bytes: float
    """Boundary traffic: inputs + outputs + parameters and buffers, per call, summed."""
    op_bytes: float
    """Unfused traffic: inputs + outputs of every non-view op inside."""
    floor_ms: float | None
    achieved: float | None
    """floor_ms / inclusive_ms: 1.0 is the roofline. It can pass 1.0 a little: the ceilings
    are measured on random data, not proven bounds."""
    has_params: bool
    container: bool


class HotspotRow(RegionStats):
    path: str
    """Module path as in `named_modules()`; "" is the model itself."""
    class_name: str
    qualname: str
    parent: str | None
    depth: int
    self_ms: float
    """Kernels launched by this module's own code, outside any child module."""
    bound: Literal["compute", "memory"] | None


class ClassRow(RegionStats):
    """All instances of one class; an instance nested in another of its class counts once."""

    class_name: str
    qualname: str
    instances: int
    paths: list[str]
    is_root: bool


class WorkloadProfile(BaseModel):
    name: str
    weight: float
    iters: int
    total_ms: float
    wall_ms: float
    """End-to-end time of one forward, measured outside the profiler."""
    rows: list[HotspotRow]
    by_class: list[ClassRow]


class ProfileResult(BaseModel):
    """hotspots.json. `rows` and `by_class` are weighted over the profiled workloads."""

    model_file: str
    model_hash: str
    device: str
    device_name: str
    generation: str
    timing_kind: Literal["gpu", "cpu"]
    time_label: str
    """"GPU time" or "CPU time": every rendering says which."""
    torch_version: str
    created_at: str
    small_kernel_us: float
    ceilings: Ceilings | None
    workloads: list[WorkloadProfile]
    total_ms: float
    rows: list[HotspotRow]
    by_class: list[ClassRow]
    trace_path: str | None = None
    notes: list[str] = []

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=2))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "ProfileResult":
        return cls.model_validate_json(Path(path).read_text())


@dataclass
class _Acc:
    """Raw totals of one module (or subtree) in one workload, over all profiled forwards."""

    us: float = 0.0
    count: int = 0
    small: int = 0
    small_us: float = 0.0
    calls: int = 0
    names: dict = field(default_factory=lambda: defaultdict(lambda: [0.0, 0]))

    def add_kernel(self, name: str, us: float, small_us: float) -> None:
        self.merge(_Acc(us, 1, *((1, us) if us < small_us and not HEAVY.search(name) else (0, 0.0))),
                   {name: [us, 1]})

    def merge(self, other: "_Acc", names: dict | None = None) -> None:
        self.us += other.us
        self.count += other.count
        self.small += other.small
        self.small_us += other.small_us
        self.calls += other.calls
        for name, (us, n) in (names if names is not None else other.names).items():
            self.names[name][0] += us
            self.names[name][1] += n


@dataclass
class _Cost:
    flops: float = 0.0
    op_bytes: float = 0.0
    boundary: float = 0.0


# ---------------------------------------------------------------------------- hooks

@contextmanager
def _module_hooks(model: torch.nn.Module, on_enter, on_exit):
    """on_enter(path, module, args, kwargs) / on_exit(path, module, args, kwargs, out) around
    every module call; always_call, so a forward that raises still closes its range."""
    handles = []
    try:
        for path, mod in model.named_modules():
            handles.append(mod.register_forward_pre_hook(partial(on_enter, path), with_kwargs=True))
            handles.append(mod.register_forward_hook(partial(on_exit, path), with_kwargs=True,
                                                     always_call=True))
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def _ranges(model: torch.nn.Module):
    stack = []

    def enter(path, mod, args, kwargs):
        rf = record_function(f"{NS}{path}::{type(mod).__name__}")
        rf.__enter__()
        stack.append(rf)

    def leave(path, mod, args, kwargs, out):
        stack.pop().__exit__(None, None, None)

    with _module_hooks(model, enter, leave):
        yield


def _nbytes(obj, seen: set[int]) -> int:
    fresh = [t for t in tensors_in(obj) if id(t) not in seen]
    seen.update(id(t) for t in fresh)
    return sum(t.numel() * t.element_size() for t in fresh)


class _CostMode(TorchDispatchMode):
    """Adds each aten op's FLOPs and bytes to the innermost module on `stack`."""

    def __init__(self, stack: list[str], costs: dict[str, _Cost]):
        super().__init__()
        self.stack, self.costs = stack, costs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        cost = self.costs[self.stack[-1] if self.stack else ROOT]
        packet = func._overloadpacket
        formula = flop_registry.get(packet) or flop_registry.get(_FLOPS_AS.get(packet))
        if formula is not None:
            try:
                cost.flops += formula(*args, **kwargs, out_val=out)
            except Exception:
                pass  # an odd signature costs a FLOP estimate, never the profile
        is_view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        if not is_view and not packet.__name__.startswith("empty"):
            cost.op_bytes += _nbytes((args, kwargs), set()) + _nbytes(out, set())
        return out


def _measure_costs(model: torch.nn.Module, inputs: list) -> dict[str, _Cost]:
    costs: dict[str, _Cost] = defaultdict(_Cost)
    stack: list[str] = []
    seen: list[set] = []
    state_bytes = {p: _nbytes([*m.parameters(), *m.buffers()], set()) for p, m in model.named_modules()}

    def enter(path, mod, args, kwargs):
        stack.append(path)
        seen.append(set())
        costs[path].boundary += _nbytes((args, kwargs), seen[-1]) + state_bytes[path]

    def leave(path, mod, args, kwargs, out):
        costs[path].boundary += _nbytes(out, seen.pop())
        stack.pop()

    with torch.no_grad(), _module_hooks(model, enter, leave), _CostMode(stack, costs):
        model(*inputs)
    return costs


# ---------------------------------------------------------------------------- attribution

def _owner(evt) -> tuple[str, str] | None:
    """(workload, module path) of the innermost ranges around `evt`; None outside a workload."""
    path = None
    while evt is not None:
        if evt.name.startswith(NSW):
            return evt.name[len(NSW):], ROOT if path is None else path
        if path is None and evt.name.startswith(NS):
            path = evt.name[len(NS):].rpartition("::")[0]
        evt = evt.cpu_parent
    return None


def _attribute(events, gpu: bool, small_us: float) -> dict[str, dict[str, _Acc]]:
    accs: dict[str, dict[str, _Acc]] = defaultdict(lambda: defaultdict(_Acc))
    for evt in events:
        if evt.device_type != DeviceType.CPU or evt.is_async or evt.name.startswith(NSW):
            continue
        owner = _owner(evt)
        if owner is None:
            continue
        acc = accs[owner[0]][owner[1]]
        is_range = evt.name.startswith(NS)
        acc.calls += is_range
        if gpu:  # a range's own `kernels` are launches outside any aten op (Triton, custom ops)
            for k in evt.kernels:
                if not k.name.startswith((NS, NSW)):  # the ranges' GPU-side annotations
                    acc.add_kernel(k.name, k.duration, small_us)
        elif not is_range and (evt.cpu_parent is None or evt.cpu_parent.name.startswith((NS, NSW))):
            acc.add_kernel(evt.name, evt.cpu_time_total, small_us)
    return accs


def _depth(path: str) -> int:
    return path.count(".") + 1 if path else 0


def _ancestors(path: str):
    while path:
        path = path.rpartition(".")[0]
        yield path


def _top(names: dict, iters: float = 1, to_ms: float = 1e-3, n: int = 3) -> list[KernelStat]:
    best = sorted(names.items(), key=lambda kv: -kv[1][0])[:n]
    # Demangled CUDA names run to kilobytes of template arguments; the head identifies them.
    return [KernelStat(name=k[:200], ms=t * to_ms / iters, count=c / iters) for k, (t, c) in best]


def _rows(model, accs: dict[str, _Acc], costs: dict[str, _Cost], iters: int,
          ceilings: Ceilings | None) -> list[HotspotRow]:
    modules = dict(model.named_modules())
    incl = {p: _Acc() for p in modules}
    cost = {p: _Cost(boundary=costs[p].boundary if p in costs else 0.0) for p in modules}
    for p in sorted(modules, key=_depth, reverse=True):  # children before their parents
        incl[p].merge(accs.get(p, _Acc()))
        cost[p].flops += costs[p].flops if p in costs else 0.0
        cost[p].op_bytes += costs[p].op_bytes if p in costs else 0.0
        if p != ROOT and (incl[p].calls or incl[p].count):
            parent = p.rpartition(".")[0]
            incl[parent].merge(incl[p])
            cost[parent].flops += cost[p].flops
            cost[parent].op_bytes += cost[p].op_bytes
            if parent not in costs:  # never called (a container): its children's traffic
                cost[parent].boundary += cost[p].boundary
    total_us, rows = incl[ROOT].us, []
    for p, mod in modules.items():
        acc, own, c = incl[p], accs.get(p, _Acc()), cost[p]
        if not (acc.calls or acc.count):
            continue
        ms = acc.us / iters / 1e3
        floor = ceilings.floor_ms(c.flops, c.boundary) if ceilings else None
        compute_bound = ceilings and (c.flops / (ceilings.matmul_tflops * 1e12)
                                      > c.boundary / (ceilings.bandwidth_gbps * 1e9))
        rows.append(HotspotRow(
            path=p, class_name=type(mod).__name__, qualname=f"{type(mod).__module__}.{type(mod).__qualname__}",
            parent=None if p == ROOT else p.rpartition(".")[0], depth=_depth(p), calls=own.calls / iters,
            inclusive_ms=ms, self_ms=own.us / iters / 1e3, share=acc.us / total_us if total_us else 0.0,
            kernels=acc.count / iters, top_kernels=_top(acc.names, iters), small_kernels=acc.small / iters,
            small_kernels_ms=acc.small_us / iters / 1e3, flops=c.flops, bytes=c.boundary, op_bytes=c.op_bytes,
            floor_ms=floor, achieved=floor / ms if floor is not None and ms > 0 else None,
            bound=None if not ceilings else ("compute" if compute_bound else "memory"),
            has_params=any(True for _ in mod.parameters()), container=isinstance(mod, CONTAINERS)))
    return rows


_SUMMED = ("calls", "inclusive_ms", "kernels", "small_kernels", "small_kernels_ms", "flops", "bytes",
           "op_bytes", "floor_ms")


def _sum_rows(rows: list, weights: list[float], total_ms: float | None = None) -> dict:
    """Weighted sums of the RegionStats fields of `rows`; floor_ms is None if any is None."""
    out = {f: sum(w * getattr(r, f) for r, w in zip(rows, weights) if getattr(r, f) is not None)
           for f in _SUMMED}
    if any(r.floor_ms is None for r in rows):
        out["floor_ms"] = None
    names: dict = defaultdict(lambda: [0.0, 0])
    for r, w in zip(rows, weights):
        for k in r.top_kernels:
            names[k.name][0] += w * k.ms
            names[k.name][1] += w * k.count
    out["top_kernels"] = _top(names, to_ms=1.0)
    incl = out["inclusive_ms"]
    out["achieved"] = out["floor_ms"] / incl if out["floor_ms"] is not None and incl > 0 else None
    if total_ms is not None:
        out["share"] = incl / total_ms if total_ms else 0.0
    return out


def _by_class(rows: list[HotspotRow], total_ms: float) -> list[ClassRow]:
    qual = {r.path: r.qualname for r in rows}
    groups: dict[str, list[HotspotRow]] = defaultdict(list)
    for r in rows:
        groups[r.qualname].append(r)
    out = []
    for qualname, members in groups.items():
        top = [r for r in members if not any(qual.get(a) == qualname for a in _ancestors(r.path))]
        out.append(ClassRow(
            class_name=members[0].class_name, qualname=qualname, instances=len(members),
            paths=[r.path for r in members], has_params=members[0].has_params,
            container=members[0].container, is_root=any(r.path == ROOT for r in members),
            **_sum_rows(top, [1.0] * len(top), total_ms)))
    return sorted(out, key=lambda c: -c.inclusive_ms)


def _weighted(profiles: list[WorkloadProfile]) -> tuple[list[HotspotRow], float]:
    """Rows averaged over workloads by weight: the metric the search optimises."""
    weights = [p.weight for p in profiles]
    if sum(weights) <= 0:  # one zero-weight workload picked by name
        weights = [1.0] * len(profiles)
    weights = [w / sum(weights) for w in weights]
    per_path: dict[str, list[tuple[HotspotRow, float]]] = defaultdict(list)
    for prof, w in zip(profiles, weights):  # dict order: module-tree order of the first workload
        for r in prof.rows:
            per_path[r.path].append((r, w))
    sums = {p: _sum_rows([r for r, _ in rw], [w for _, w in rw]) for p, rw in per_path.items()}
    total = sums[ROOT]["inclusive_ms"] if ROOT in sums else 0.0
    rows = [HotspotRow(**{**rw[0][0].model_dump(), **sums[p], "self_ms": sum(r.self_ms * w for r, w in rw),
                          "share": sums[p]["inclusive_ms"] / total if total else 0.0})
            for p, rw in per_path.items()]
    return rows, total


# ---------------------------------------------------------------------------- public

def _select(loaded: LoadedModel, workload: str | None) -> list[WorkloadInputs]:
    if workload is None:
        return list(loaded.workloads)
    picked = [w for w in loaded.workloads if w.name == workload]
    if not picked:
        raise ValueError(f"no workload named {workload!r} (has: {', '.join(w.name for w in loaded.workloads)})")
    return picked


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _wall_ms(model, inputs: list, dev: torch.device, iters: int) -> float:
    times = []
    for _ in range(iters):
        _sync(dev)
        t0 = time.perf_counter()
        model(*inputs)
        _sync(dev)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def profile_model(loaded: LoadedModel, device: str | torch.device, workload: str | None = None,
                  ceilings: Ceilings | None = None, *, iters: int = 3, warmup: int = 2,
                  trace_path: str | Path | None = None, hotspots_path: str | Path | None = None,
                  small_kernel_us: float | None = None) -> ProfileResult:
    """Profile `iters` forwards of each selected workload (all when `workload` is None) after
    `warmup` forwards, attribute time to modules (see the module docstring), and write the
    Chrome trace and hotspots.json when paths are given. Without ceilings, floors are None."""
    dev = torch.device(device)
    gpu = dev.type == "cuda"
    model, workloads, notes = loaded.model, _select(loaded, workload), []
    small_us = small_kernel_us if small_kernel_us is not None else (50.0 if gpu else 1000.0)
    costs = {}
    for w in workloads:
        try:
            costs[w.name] = _measure_costs(model, w.inputs)
        except Exception as e:  # FLOPs are an estimate; losing them must not lose the profile
            costs[w.name] = {}
            notes.append(f"FLOP/byte count failed on workload {w.name!r}: {type(e).__name__}: {e}")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    wall = {}
    with torch.no_grad():
        for w in workloads:
            for _ in range(warmup):
                model(*w.inputs)
            wall[w.name] = _wall_ms(model, w.inputs, dev, iters)
        with warnings.catch_warnings():
            # torch 2.11 warns that a new cycle drops the last cycle's events; we run one cycle.
            warnings.filterwarnings("ignore", message=".*Profiler clears events")
            with _ranges(model), profile(activities=activities, record_shapes=True) as prof:
                for w in workloads:
                    with record_function(NSW + w.name):
                        for _ in range(iters):
                            model(*w.inputs)
                    _sync(dev)
    accs = _attribute(prof.events(), gpu, small_us)
    if trace_path is not None:
        Path(trace_path).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path))
    per = []
    for w in workloads:
        rows = _rows(model, accs.get(w.name, {}), costs[w.name], iters, ceilings)
        total = next((r.inclusive_ms for r in rows if r.path == ROOT), 0.0)
        if total == 0:
            notes.append(f"workload {w.name!r}: no time attributed"
                         + (" (no device kernel was linked to its launching op)" if gpu else ""))
        per.append(WorkloadProfile(name=w.name, weight=w.weight, iters=iters, total_ms=total,
                                   wall_ms=wall[w.name], rows=rows, by_class=_by_class(rows, total)))
    rows, total = _weighted(per)
    info = device_info(dev)
    result = ProfileResult(
        model_file=str(loaded.path), model_hash=loaded.file_hash, device=str(dev), device_name=info.name,
        generation=info.generation, timing_kind="gpu" if gpu else "cpu",
        time_label="GPU time" if gpu else "CPU time", torch_version=torch.__version__,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), small_kernel_us=small_us,
        ceilings=ceilings, workloads=per, total_ms=total, rows=rows, by_class=_by_class(rows, total),
        trace_path=None if trace_path is None else str(trace_path), notes=notes)
    if hotspots_path is not None:
        result.save(hotspots_path)
    return result


def _inside(q: str, p: str) -> bool:
    """Module path q is p or lies below it."""
    return p == ROOT or q == p or q.startswith(p + ".")


def select_regions(result: ProfileResult, coverage: float = 0.9, max_regions: int = 8,
                   exclude: tuple[str, ...] = ("Model",), min_share: float = 0.05) -> list[ClassRow]:
    """Classes to tune, heaviest first, until they cover `coverage` of the model's time.

    Never the root model, a container (ModuleList/ModuleDict/Sequential) or a class named in
    `exclude`. User-defined classes come before torch's own (nn.Linear is one cuBLAS call with
    nothing to fuse on its own, and choosing it would block the user classes around it).
    Skip a *coarse* class: one whose instances contain two or more other user-defined classes
    with at least `min_share` each (a decoder layer holding attention and MLP: its parts are
    the better problems). Skip a class that nests with one already chosen (an instance inside
    or around a chosen instance): a class's winner replaces its forward everywhere, so chosen
    regions must not overlap, and their shares add up to the coverage reached.
    """
    candidates = [c for c in result.by_class if not c.is_root and not c.container and c.inclusive_ms > 0
                  and c.class_name not in exclude and c.qualname not in exclude]

    def nests(a: ClassRow, b: ClassRow) -> bool:
        return any(_inside(p, q) or _inside(q, p) for p in a.paths for q in b.paths)

    def builtin(c: ClassRow) -> bool:
        return c.qualname.startswith("torch.")

    def coarse(c: ClassRow) -> bool:
        inner = {d.qualname for d in candidates if d is not c and not builtin(d) and d.share >= min_share
                 and any(q != p and _inside(q, p) for p in c.paths for q in d.paths)}
        return len(inner) >= 2

    chosen, covered = [], 0.0
    for c in sorted(candidates, key=lambda c: (builtin(c), -c.inclusive_ms)):
        if covered >= coverage or len(chosen) >= max_regions:
            break
        if not coarse(c) and not any(nests(c, s) for s in chosen):
            chosen.append(c)
            covered += c.share
    return chosen


def render_hotspots(result: ProfileResult, top: int = 15, workload: str | None = None) -> Table:
    """The `top` regions by inclusive time, in module-tree order, indented by depth."""
    if workload is not None:
        wp = next((w for w in result.workloads if w.name == workload), None)
        if wp is None:
            raise ValueError(f"no profiled workload named {workload!r}")
        rows, total, label = wp.rows, wp.total_ms, f"workload {workload}"
    else:
        rows, total = result.rows, result.total_ms
        label = ("weighted over " + ", ".join(f"{w.name} x{w.weight:g}" for w in result.workloads)
                 if len(result.workloads) > 1 else f"workload {result.workloads[0].name}")
    keep = {r.path for r in sorted(rows, key=lambda r: -r.inclusive_ms)[:top] if r.inclusive_ms > 0}
    unit = result.time_label.split()[0]
    table = Table(title=f"Hotspots: {result.time_label} per forward, {label}, total {total:.3f} ms "
                        f"on {result.device_name}",
                  caption=f"roofline = floor / measured, floor from measured ceilings; small kernels = "
                          f"not GEMM/conv/attention and < {result.small_kernel_us:g} us (fusion candidates)")
    for name in ["module", "class", "calls", f"incl ms ({unit})", f"self ms ({unit})", "share",
                 "launches", "small kernels", "roofline", "top kernel"]:
        table.add_column(name, justify="left" if name in ("module", "class", "top kernel") else "right",
                         overflow="fold" if name == "module" else "ellipsis")
    def count(x: float) -> str:  # weighted over workloads, a count can be fractional
        return f"{x:.0f}" if abs(x - round(x)) < 0.05 else f"{x:.1f}"

    for r in (r for r in rows if r.path in keep):
        k = r.top_kernels[0] if r.top_kernels else None
        table.add_row("  " * r.depth + (r.path or "(model)"), r.class_name, count(r.calls),
                      f"{r.inclusive_ms:.3f}", f"{r.self_ms:.3f}", f"{r.share:.1%}", count(r.kernels),
                      f"{count(r.small_kernels)} / {r.small_kernels_ms:.3f} ms",
                      "-" if r.achieved is None else f"{r.achieved:.0%}",
                      f"{k.name[:48]} {k.ms:.3f} ms" if k else "-")
    return table


def torch_profiler_table(loaded: LoadedModel, device: str | torch.device, workload: str | None = None,
                         *, iters: int = 3, row_limit: int = 30) -> str:
    """The plain torch.profiler key_averages table for one workload (the first when None),
    sorted by self device time (self CPU time on the CPU), to compare with the hotspots."""
    dev = torch.device(device)
    gpu = dev.type == "cuda"
    w = _select(loaded, workload)[0]
    with torch.no_grad():
        for _ in range(2):
            loaded.model(*w.inputs)
        _sync(dev)
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as prof:
            for _ in range(iters):
                loaded.model(*w.inputs)
            _sync(dev)
    averages = prof.key_averages()
    sort = "self_cpu_time_total"
    if gpu:  # named self_cuda_time_total before torch 2.4
        sort = next((s for s in ("self_device_time_total", "self_cuda_time_total")
                     if averages and hasattr(averages[0], s)), sort)
    header = f"torch.profiler key_averages: workload {w.name}, {iters} forwards, sorted by {sort}\n"
    return header + averages.table(sort_by=sort, row_limit=row_limit)
