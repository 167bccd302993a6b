"""The profile's results and what is computed from rows alone: the pydantic models saved as
hotspots.json, the sums over rows (per class, weighted over workloads) and the hotspot table.
Choosing regions is `tools.selection`; measuring is `tools.profiler`, which re-exports both."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Literal

from pydantic import BaseModel
from rich.table import Table

from tools import strict_json
from tools.devices import Ceilings

ROOT = ""  # the module path of the model itself


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
    bound: Literal["compute", "memory"] | None = None
    """Which roofline ceiling sets floor_ms: its FLOPs at the matmul peak take longer than its
    boundary bytes at the copy bandwidth (`compute`), or not (`memory`); None without ceilings."""


class HotspotRow(RegionStats):
    path: str
    """Module path as in `named_modules()`; "" is the model itself."""
    class_name: str
    qualname: str
    parent: str | None
    depth: int
    self_ms: float
    """Kernels launched by this module's own code, outside any child module."""


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
        path.write_text(strict_json.dumps(self, indent=2))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "ProfileResult":
        return cls.model_validate_json(Path(path).read_text())


# ---------------------------------------------------------------------------- aggregation

def _ancestors(path: str):
    while path:
        path = path.rpartition(".")[0]
        yield path


def _top(names: dict, iters: float = 1, to_ms: float = 1e-3, n: int = 3) -> list[KernelStat]:
    best = sorted(names.items(), key=lambda kv: -kv[1][0])[:n]
    # Demangled CUDA names run to kilobytes of template arguments; the head identifies them.
    return [KernelStat(name=k[:200], ms=t * to_ms / iters, count=c / iters) for k, (t, c) in best]


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


def _bound(sums: dict, ceilings: Ceilings | None) -> str | None:
    return ceilings.bound(sums["flops"], sums["bytes"]) if ceilings else None


def _by_class(rows: list[HotspotRow], total_ms: float, ceilings: Ceilings | None = None) -> list[ClassRow]:
    qual = {r.path: r.qualname for r in rows}
    groups: dict[str, list[HotspotRow]] = defaultdict(list)
    for r in rows:
        groups[r.qualname].append(r)
    out = []
    for qualname, members in groups.items():
        top = [r for r in members if not any(qual.get(a) == qualname for a in _ancestors(r.path))]
        sums = _sum_rows(top, [1.0] * len(top), total_ms)
        out.append(ClassRow(
            class_name=members[0].class_name, qualname=qualname, instances=len(members),
            paths=[r.path for r in members], has_params=members[0].has_params,
            container=members[0].container, is_root=any(r.path == ROOT for r in members),
            bound=_bound(sums, ceilings), **sums))
    return sorted(out, key=lambda c: -c.inclusive_ms)


def _weighted(profiles: list[WorkloadProfile], ceilings: Ceilings | None = None) -> tuple[list[HotspotRow], float]:
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
                          "share": sums[p]["inclusive_ms"] / total if total else 0.0,
                          "bound": _bound(sums[p], ceilings) if ceilings else rw[0][0].bound})
            for p, rw in per_path.items()]
    return rows, total


# ---------------------------------------------------------------------------- rendering

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
