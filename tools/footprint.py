"""Whether a problem fits in memory, decided while its inputs are captured, before anything
is written: a problem too large for the sandbox would otherwise stall the run at its first
trial (KernelBench's level-1 norms have 6-8 GB of inputs).

The estimate counts what holds the frozen tensors today, per problem:

- freezing (this process, host): every workload's inputs and outputs once (a device run
  copies them to the host; on the CPU, tensors nothing changes are shared, not copied);
- a sandbox worker (host): the frozen inputs, the fresh random inputs (the same size) and
  their references, and during verification the outputs and inputs of three runs copied
  back: `WORKER_HOST_INPUTS` x inputs + `WORKER_HOST_OUTPUTS` x outputs;
- a sandbox worker (device): the region's state plus the largest workload's inputs and
  outputs `WORKER_DEVICE_IO` times (cloned inputs, outputs, a candidate's temporaries).

The tuner's runner also holds the inputs and references once per worker; that is counted
with the workers. Numbers are estimates with headroom, not measurements.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

WORKER_HOST_INPUTS = 5
WORKER_HOST_OUTPUTS = 5
WORKER_DEVICE_IO = 3
CPU_WORKER_CAP_GB = 8.0
"""The CPU worker's address-space cap (sandbox.client.WorkerConfig.memory_gb)."""
CPU_WORKER_BASE_GB = 3.0
"""Address space a CPU worker uses before any problem (torch, Triton, the interpreter)."""
GPU_MEMORY_FRACTION = 0.9
"""The share of a GPU a worker may allocate (sandbox.client.WorkerConfig.gpu_memory_fraction)."""
GB = 1 << 30


class DoesNotFit(Exception):
    """A problem that cannot be held in memory; the message says what is short, and by how much."""


def host_available() -> int:
    """Bytes the OS says can still be allocated (MemAvailable), or 0 when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def device_total(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    try:
        return torch.cuda.mem_get_info(device)[1]
    except Exception:  # a device we cannot ask: no device check
        return 0


@dataclass
class Admission:
    """Running totals for one region's capture; `admit` raises DoesNotFit as soon as the
    workloads seen so far already cannot fit."""

    device: torch.device
    state_bytes: int
    copies: bool
    """Whether capture copies tensors to the host (a device run), or mostly shares them."""
    host_free: int = field(default_factory=host_available)
    inputs: int = 0
    outputs: int = 0
    largest_io: int = 0

    def admit(self, in_bytes: int, out_bytes: int) -> None:
        self.inputs += in_bytes
        self.outputs += out_bytes
        self.largest_io = max(self.largest_io, in_bytes + out_bytes)
        if self.copies and self.host_free and self.inputs + self.outputs > 0.8 * self.host_free:
            raise DoesNotFit(f"its inputs and outputs ({_gb(self.inputs + self.outputs)}) do not fit in the host "
                             f"memory available to freeze them ({_gb(self.host_free)})")
        worker = self.worker_host()
        if self.device.type == "cpu":
            cap = (CPU_WORKER_CAP_GB - CPU_WORKER_BASE_GB) * GB
            if worker > cap:
                raise DoesNotFit(f"a CPU sandbox worker would need about {_gb(worker)} for its inputs "
                                 f"({_gb(self.inputs)}) and outputs ({_gb(self.outputs)}), over its "
                                 f"{CPU_WORKER_CAP_GB:g} GB address-space cap")
        elif self.host_free and worker > self.host_free:
            raise DoesNotFit(f"one sandbox worker would need about {_gb(worker)} of host memory for its inputs "
                             f"({_gb(self.inputs)}) and outputs ({_gb(self.outputs)}); {_gb(self.host_free)} available")
        total = device_total(self.device)
        if total and self.worker_device() > GPU_MEMORY_FRACTION * total:
            raise DoesNotFit(f"one sandbox worker would need about {_gb(self.worker_device())} of device memory "
                             f"(state {_gb(self.state_bytes)}, largest workload {_gb(self.largest_io)}), over "
                             f"{GPU_MEMORY_FRACTION:.0%} of the device's {_gb(total)}")

    def worker_host(self) -> int:
        return WORKER_HOST_INPUTS * self.inputs + WORKER_HOST_OUTPUTS * self.outputs

    def worker_device(self) -> int:
        return self.state_bytes + WORKER_DEVICE_IO * self.largest_io

    def workers_that_fit(self) -> int | None:
        """How many sandbox workers fit at once, by host and device memory (None: unknown)."""
        counts = []
        if self.host_free and self.worker_host():
            counts.append(int(self.host_free // self.worker_host()))
        total = device_total(self.device)
        if total and self.worker_device():
            counts.append(int(GPU_MEMORY_FRACTION * total // self.worker_device()))
        return min(counts) if counts else None

    def note(self) -> str | None:
        """A note for the problem when memory, not cores, limits the workers."""
        n = self.workers_that_fit()
        if n is None or n >= 8:
            return None
        return (f"memory: each sandbox worker holds about {_gb(self.worker_host())} of host and "
                f"{_gb(self.worker_device())} of device memory for this problem; about {n} fit at once")


def _gb(n: float) -> str:
    return f"{n / GB:.2f} GB" if n < 10 * GB else f"{n / GB:.0f} GB"
