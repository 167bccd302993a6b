"""Which devices this machine has, what their ceilings are, and which software runs them.

The ceilings (copy bandwidth, dense matmul throughput) turn a region's FLOPs and bytes into
a floor time, so the profiler can say how far a region is from its roofline. They are
measured, not taken from a datasheet: a datasheet number is never reached, and a floor
nobody can reach makes every region look equally bad. Measuring takes a few seconds, so the
result is cached per device name and torch version in `$NIGHTSHIFT_CACHE/ceilings.json`
(default `~/.cache/nightshift/ceilings.json`).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel

from tools import strict_json

CACHE_FILE = "ceilings.json"


class DeviceInfo(BaseModel):
    """One device a trial can run on. The CPU is listed too: it is the fallback device."""

    kind: Literal["cuda", "rocm", "cpu"]
    index: int | None
    """Index as torch sees it (after CUDA_VISIBLE_DEVICES); None for the CPU."""
    torch_device: str
    """`cuda:0`, `cpu`: what to pass to torch."""
    name: str
    generation: str
    """`sm90` from the compute capability, the gfx arch on ROCm (`gfx942`), `cpu`."""
    total_memory_bytes: int
    driver_version: str = "unknown"
    multiprocessors: int | None = None


class Ceilings(BaseModel):
    """Measured peaks of one device: the denominators of the roofline floor."""

    device_name: str
    bandwidth_gbps: float
    """Device-to-device copy, read + write bytes counted, GB/s (1e9 bytes)."""
    matmul_tflops: float
    """Dense square matmul in `dtype`, TFLOP/s (1e12)."""
    dtype: str
    """Matmul dtype: bfloat16 on GPUs, float32 on the CPU. A model running in a slower dtype
    (fp32 on a GPU) gets a floor that is too low, which only makes `achieved` pessimistic."""
    measured_at: str
    torch_version: str = ""
    copy_bytes: int = 0
    matmul_n: int = 0

    def floor_ms(self, flops: float, nbytes: float) -> float:
        """The roofline floor: whichever of compute and memory traffic takes longer."""
        compute_s = flops / (self.matmul_tflops * 1e12) if self.matmul_tflops > 0 else 0.0
        memory_s = nbytes / (self.bandwidth_gbps * 1e9) if self.bandwidth_gbps > 0 else 0.0
        return 1e3 * max(compute_s, memory_s)

    def bound(self, flops: float, nbytes: float) -> str:
        """`compute` when the FLOPs take longer than the bytes at these peaks, else `memory`."""
        compute_s = flops / (self.matmul_tflops * 1e12) if self.matmul_tflops > 0 else 0.0
        memory_s = nbytes / (self.bandwidth_gbps * 1e9) if self.bandwidth_gbps > 0 else 0.0
        return "compute" if compute_s > memory_s else "memory"


# ---------------------------------------------------------------------------- discovery

def host_cores() -> int:
    """CPU cores this process may run on (its affinity where the OS says, else the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _cpu_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _driver_version() -> str:
    """Best effort, never raises: NVML, then nvidia-smi / rocm-smi, then the CUDA driver API."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else str(v)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        pass
    cmds = ([["rocm-smi", "--showdriverversion", "--json"]] if torch.version.hip else
            [["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]])
    for cmd in cmds:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            continue
        if out and cmd[0] == "nvidia-smi":
            return out.splitlines()[0].strip()
        if out:
            try:
                values = [v for card in json.loads(out).values() for v in card.values()]
                return str(values[0]) if values else "unknown"
            except (ValueError, AttributeError):
                pass
    try:
        v = torch._C._cuda_getDriverVersion()  # the driver's CUDA API level, e.g. 12040
        return f"CUDA driver API {v // 1000}.{v % 1000 // 10}" if v else "unknown"
    except Exception:
        return "unknown"


def _gpu_info(index: int, driver: str) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip:
        kind, generation = "rocm", (getattr(props, "gcnArchName", "") or "gfx?").split(":")[0]
    else:
        kind, generation = "cuda", f"sm{props.major}{props.minor}"
    return DeviceInfo(kind=kind, index=index, torch_device=f"cuda:{index}", name=props.name,
                      generation=generation, total_memory_bytes=int(props.total_memory),
                      driver_version=driver, multiprocessors=props.multi_processor_count)


def cpu_info() -> DeviceInfo:
    return DeviceInfo(kind="cpu", index=None, torch_device="cpu", name=_cpu_name(), generation="cpu",
                      total_memory_bytes=_cpu_memory_bytes(), driver_version="n/a",
                      multiprocessors=os.cpu_count())


def list_devices() -> list[DeviceInfo]:
    """Every visible GPU (CUDA_VISIBLE_DEVICES applies, torch handles it), then the CPU."""
    gpus = []
    if torch.cuda.is_available():
        driver = _driver_version()
        gpus = [_gpu_info(i, driver) for i in range(torch.cuda.device_count())]
    return gpus + [cpu_info()]


def device_info(device: str | torch.device | DeviceInfo) -> DeviceInfo:
    if isinstance(device, DeviceInfo):
        return device
    dev = torch.device(device)
    if dev.type == "cpu":
        return cpu_info()
    if dev.type != "cuda":
        raise ValueError(f"unsupported device {dev}: use cuda[:N] or cpu")
    return _gpu_info(dev.index if dev.index is not None else torch.cuda.current_device(), _driver_version())


# ---------------------------------------------------------------------------- ceilings

def _median_ms_gpu(fn, dev: torch.device, warmup: int, reps: int) -> float:
    with torch.cuda.device(dev):
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize(dev)
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                 for _ in range(reps)]
        for start, end in pairs:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(dev)
        return statistics.median(s.elapsed_time(e) for s, e in pairs)


def _median_ms_cpu(fn, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure_ceilings(device: str | torch.device | DeviceInfo, *, copy_bytes: int | None = None,
                     matmul_n: int | None = None, reps: int | None = None) -> Ceilings:
    """Measure copy bandwidth and matmul throughput now (no cache). GPU: 1 GiB copy and a
    bf16 8192^3 matmul timed with CUDA events; CPU: 64 MiB and fp32 1024^3 with perf_counter.
    The median of `reps` timings after warm-up; buffers are freed before returning."""
    info = device_info(device)
    dev = torch.device(info.torch_device)
    gpu = dev.type == "cuda"
    copy_bytes = copy_bytes or (1 << 30 if gpu else 64 << 20)
    n = matmul_n or (8192 if gpu else 1024)
    reps = reps or (10 if gpu else 5)
    dtype = torch.bfloat16 if gpu else torch.float32
    time_ms = ((lambda fn: _median_ms_gpu(fn, dev, 3, reps)) if gpu
               else (lambda fn: _median_ms_cpu(fn, 2, reps)))

    src = torch.empty(copy_bytes, dtype=torch.uint8, device=dev).fill_(1)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src))
    del src, dst
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    c = torch.empty(n, n, device=dev, dtype=dtype)
    mm_ms = time_ms(lambda: torch.mm(a, b, out=c))
    del a, b, c
    if gpu:
        torch.cuda.empty_cache()
    return Ceilings(
        device_name=info.name,
        bandwidth_gbps=2 * copy_bytes / (copy_ms * 1e-3) / 1e9,  # one read + one write per byte
        matmul_tflops=2 * n**3 / (mm_ms * 1e-3) / 1e12,
        dtype=str(dtype).removeprefix("torch."),
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        torch_version=torch.__version__, copy_bytes=copy_bytes, matmul_n=n)


def cache_path() -> Path:
    root = os.environ.get("NIGHTSHIFT_CACHE") or Path.home() / ".cache" / "nightshift"
    return Path(root) / CACHE_FILE


def _cache_key(info: DeviceInfo) -> str:
    # CPU throughput depends on how many threads torch may use, so it is part of the key.
    threads = f" | {torch.get_num_threads()} threads" if info.kind == "cpu" else ""
    return f"{info.name} | torch {torch.__version__}{threads}"


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # a missing or corrupt cache only costs a re-measurement


def get_ceilings(device: str | torch.device | DeviceInfo, refresh: bool = False) -> Ceilings:
    """Ceilings for `device`, from the cache unless `refresh` or not yet measured."""
    info = device_info(device)
    path, key = cache_path(), _cache_key(info)
    cache = _read_cache(path)
    if not refresh and key in cache:
        try:
            return Ceilings.model_validate(cache[key])
        except ValueError:
            pass
    ceilings = measure_ceilings(info)
    cache = _read_cache(path)  # re-read: another process may have written meanwhile
    cache[key] = ceilings.model_dump()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(strict_json.dumps(cache, indent=2, sort_keys=True))
    os.replace(tmp, path)  # atomic, so a concurrent reader never sees half a file
    return ceilings


# ---------------------------------------------------------------------------- versions

def _nightshift_version() -> str:
    try:
        from importlib.metadata import version

        return version("nightshift")
    except Exception:
        pass
    try:
        import tomllib

        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"] + " (source tree)"
    except Exception:
        return "unknown"


def software_versions() -> dict[str, str | None]:
    """Versions recorded with every trial; None where a component is absent."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "cudnn": str(cudnn) if cudnn else None,
        "nightshift": _nightshift_version(),
    }
