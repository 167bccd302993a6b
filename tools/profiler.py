"""Profile a model and attribute its device time to the module tree.

Every module's forward is wrapped (pre/post hooks) in a profiler range `ns::<path>::<Class>`,
and every forward of a workload in `nsw::<workload>@<i>`. Time is then attributed as follows:

- GPU: the profiler links each device kernel (and memcpy/memset) to the CPU op that launched
  it through the CUDA/HIP correlation id, and lists it in that op's `kernels`. We walk the
  launching op's `cpu_parent` chain up to the innermost `ns::` range. This uses the launch
  site, not device timestamps, so it stays right while the GPU runs behind the CPU (async
  launches, several streams), where matching device times against CPU ranges would not.
- CPU: there are no kernels; a "kernel" is each aten op a module's own code calls (the op
  directly under an `ns::` range), timed by its total CPU time. Leaf ops would miss the
  work inside composite ops (`aten::addmm`'s own time is its GEMM), so we take the outermost
  op instead. All times are then CPU times, and every rendering says so.

Each module's own time is the median over the profiled forwards (times their count), not the
sum: on a loaded machine one preempted op in one forward can otherwise put a fifth of a small
model's time in a mask or a residual add, and change which regions are chosen.

Inclusive time of a region is the sum over its subtree, so a fusion opportunity across
children (residual add + norm, SiLU * mul) shows up at their parent. FLOPs and bytes come
from one extra forward under a dispatch mode (torch's FLOP formulas; bytes of every non-view
op). The roofline floor uses the region's boundary traffic (inputs + outputs + parameters):
what an ideally fused kernel would still move. Modules called via `.forward()` directly
skip hooks; their time is counted in the caller.

The result models (hotspots.json), the sums over rows (classes, workload weights) and the
hotspot table live in `tools.hotspots`, region selection in `tools.selection`; their public
names are re-exported here, so `from tools.profiler import ProfileResult, select_regions, ...` keeps working.
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

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from tools.devices import Ceilings, device_info
from tools.hotspots import ROOT, HotspotRow, ProfileResult, WorkloadProfile, _by_class, _top, _weighted
# Re-exported: public names that moved to tools.hotspots, for existing `tools.profiler` imports.
from tools.hotspots import ClassRow, KernelStat, RegionStats, render_hotspots  # noqa: F401
from tools.selection import RegionVerdict, plan_regions, select_regions  # noqa: F401
from tools.modelfile import LoadedModel, WorkloadInputs, tensors_in

NS, NSW = "ns::", "nsw::"
CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)
# Kernels a fusion does not remove: GEMMs, convolutions, attention. The rest are candidates.
HEAVY = re.compile(r"gemm|gemv|matmul|\bmm\b|addmm|bmm|linear|conv|attention|attn|flash|fmha|sdpa|"
                   r"cutlass|cublas|nvjet|xmma|wgmma", re.I)
_aten = torch.ops.aten
_FLOPS_AS = {_aten._scaled_dot_product_flash_attention_for_cpu: _aten._scaled_dot_product_flash_attention}


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
            if isinstance(mod, torch.jit.ScriptModule):  # TorchScript takes no Python hooks: its time is its parent's
                continue
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
    """(workload@forward, module path) of the innermost ranges around `evt`; None outside a workload."""
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


def _per_forward_median(forwards: list[dict[str, _Acc]]) -> dict[str, _Acc]:
    """One workload's totals over its forwards, each module's time the median forward's times
    their number (counts stay summed: `_rows` divides everything by the number of forwards)."""
    out: dict[str, _Acc] = defaultdict(_Acc)
    for accs in forwards:
        for path, acc in accs.items():
            out[path].merge(acc)
    for path, acc in out.items():
        typical = statistics.median(f[path].us if path in f else 0.0 for f in forwards) * len(forwards)
        scale = typical / acc.us if acc.us > 0 else 1.0
        acc.us, acc.small_us = typical, acc.small_us * scale
        for entry in acc.names.values():
            entry[0] *= scale
    return out


def _depth(path: str) -> int:
    return path.count(".") + 1 if path else 0


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
        rows.append(HotspotRow(
            path=p, class_name=type(mod).__name__, qualname=f"{type(mod).__module__}.{type(mod).__qualname__}",
            parent=None if p == ROOT else p.rpartition(".")[0], depth=_depth(p), calls=own.calls / iters,
            inclusive_ms=ms, self_ms=own.us / iters / 1e3, share=acc.us / total_us if total_us else 0.0,
            kernels=acc.count / iters, top_kernels=_top(acc.names, iters), small_kernels=acc.small / iters,
            small_kernels_ms=acc.small_us / iters / 1e3, flops=c.flops, bytes=c.boundary, op_bytes=c.op_bytes,
            floor_ms=floor, achieved=floor / ms if floor is not None and ms > 0 else None,
            bound=ceilings.bound(c.flops, c.boundary) if ceilings else None,
            has_params=any(True for _ in mod.parameters()), container=isinstance(mod, CONTAINERS)))
    return rows


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
                    for i in range(iters):
                        with record_function(f"{NSW}{w.name}@{i}"):
                            model(*w.inputs)
                    _sync(dev)
    by_forward = _attribute(prof.events(), gpu, small_us)
    accs = {w.name: _per_forward_median([by_forward.get(f"{w.name}@{i}", {}) for i in range(iters)])
            for w in workloads}
    if trace_path is not None:
        try:  # the trace is for people to look at; failing to write it loses nothing else
            Path(trace_path).parent.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(trace_path))
        except Exception as e:
            notes.append(f"trace: not written ({type(e).__name__}: {str(e)[:160]})")
            trace_path = None
    per = []
    for w in workloads:
        rows = _rows(model, accs.get(w.name, {}), costs[w.name], iters, ceilings)
        total = next((r.inclusive_ms for r in rows if r.path == ROOT), 0.0)
        if total == 0:
            notes.append(f"workload {w.name!r}: no time attributed"
                         + (" (no device kernel was linked to its launching op)" if gpu else ""))
        per.append(WorkloadProfile(name=w.name, weight=w.weight, iters=iters, total_ms=total,
                                   wall_ms=wall[w.name], rows=rows, by_class=_by_class(rows, total, ceilings)))
    rows, total = _weighted(per, ceilings)
    info = device_info(dev)
    result = ProfileResult(
        model_file=str(loaded.path), model_hash=loaded.file_hash, device=str(dev), device_name=info.name,
        generation=info.generation, timing_kind="gpu" if gpu else "cpu",
        time_label="GPU time" if gpu else "CPU time", torch_version=torch.__version__,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), small_kernel_us=small_us,
        ceilings=ceilings, workloads=per, total_ms=total, rows=rows, by_class=_by_class(rows, total, ceilings),
        trace_path=None if trace_path is None else str(trace_path), notes=notes)
    if hotspots_path is not None:
        result.save(hotspots_path)
    return result


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
