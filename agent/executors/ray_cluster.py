"""The cluster side of the Ray executor: connecting, finding the device pools, shipping the
frozen problems once, and the actor that hosts sandbox TrialRunners on a node. The scheme is
described in `agent.executors.ray`'s docstring."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.executors.local import workers_per_gpu
from sandbox.pool import SEARCH_COMPILE_THREADS, DevicePool
from sandbox.runner import Limits
from tools import seal, strict_json
from tools.trial import Candidate

GEN_PREFIX = "gen:"
ACCEL_PREFIX = "accelerator_type:"
INSTALL_HINT = "pip install 'nightshift[ray]'"
ROOT = Path(__file__).resolve().parent.parent.parent
# Shipped to the cluster as the job's working_dir when this is a source checkout.
CODE_EXCLUDES = ["runs", ".git", "tests", "bench", "build", "dist", ".venv", "*.egg-info", ".pytest_cache",
                 ".nightshift-cache", "__pycache__", ".whl", ".raypkg"]
MODEL_SIBLINGS_MAX_BYTES = 1 << 20


class ClusterError(ValueError):
    """The cluster cannot run this job (a target generation without workers, say)."""


def import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError(f"--executor ray needs Ray: {INSTALL_HINT}") from None
    return ray


def connect(address: str | None = None) -> bool:
    """Join the Ray cluster at `address` (or start a local one); True if this call did it.
    The code travels as the job's working_dir when it runs from a source checkout."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    import logging
    kwargs: dict[str, Any] = dict(log_to_driver=False, ignore_reinit_error=True, logging_level=logging.WARNING)
    if (ROOT / "pyproject.toml").is_file() and (ROOT / "sandbox" / "worker.py").is_file():
        kwargs["runtime_env"] = {"working_dir": str(ROOT), "excludes": CODE_EXCLUDES}
    if address:
        ray.init(address=address, **kwargs)
    else:
        import torch
        extra = {} if torch.cuda.is_available() else {"resources": {f"{GEN_PREFIX}cpu": 1}}
        ray.init(address="local", include_dashboard=False, **extra, **kwargs)
    return True


# -- pools: which node serves which generation, with how many workers ------------------------
@dataclass
class PoolSlot:
    generation: str
    node_id: str
    count: int
    gpu: bool
    resource: str
    amount: float
    workers: int = 1
    """Sandbox workers per device: as `local.default_workers_per_gpu` for the node's cores (its GPUs' memory
    is not known from here)."""


def discover(nodes: list[dict]) -> dict[str, list[PoolSlot]]:
    """Per generation, the nodes serving it (from `ray.nodes()`), by the scheme above."""
    pools: dict[str, list[PoolSlot]] = {}
    for n in nodes:
        if not n.get("Alive", n.get("alive", False)):
            continue
        res, node = n.get("Resources", {}), n["NodeID"]
        gpus = int(res.get("GPU", 0))
        workers = workers_per_gpu(int(res.get("CPU", 0)), gpus) if gpus else 1
        gens = {k[len(GEN_PREFIX):]: int(v) for k, v in res.items() if k.startswith(GEN_PREFIX) and int(v) > 0}
        if gens:
            for g, count in gens.items():
                pools.setdefault(g, []).append(PoolSlot(g, node, count, gpus > 0, GEN_PREFIX + g, 1.0, workers))
        elif gpus > 0:
            kinds = sorted(k for k in res if k.startswith(ACCEL_PREFIX))
            g = kinds[0][len(ACCEL_PREFIX):] if kinds else "gpu"
            pools.setdefault(g, []).append(PoolSlot(g, node, gpus, True, kinds[0] if kinds else "GPU",
                                                    0.001 if kinds else 0.0, workers))
    return pools


# -- the problems, shipped once -----------------------------------------------------------------
def pack_problems(problem_dirs: list[Path]) -> list[dict]:
    """Every file of each frozen problem folder, and its model file (with small sibling
    modules), as bytes: one object in Ray's object store for the whole cluster."""
    from tools.problem import Problem
    out = []
    for d in problem_dirs:
        d = Path(d).resolve()
        problem = Problem.load(d)
        files = {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}
        model = Path(problem.model_file)
        siblings = [p for p in sorted(model.parent.glob("*.py")) if p != model]
        if sum(p.stat().st_size for p in siblings) > MODEL_SIBLINGS_MAX_BYTES:
            siblings = []
        out.append({"name": problem.name, "files": files, "model_name": model.name,
                    "model_files": {p.name: p.read_bytes() for p in [model, *siblings]}})
    return out


def unpack_problems(packed: list[dict], root: Path) -> list[Path]:
    """Write the problems under `root` and point each at its local copy of the model file."""
    import json
    folders = []
    for i, p in enumerate(packed):
        model_dir = root / "model" / str(i)
        model_dir.mkdir(parents=True)
        for name, data in p["model_files"].items():
            (model_dir / name).write_bytes(data)
        folder = root / "problems" / p["name"]
        for rel, data in p["files"].items():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_bytes(data)
        meta = json.loads((folder / "problem.json").read_text())
        meta["model_file"] = str(model_dir / p["model_name"])  # hashes cover the tensors, not this path
        (folder / "problem.json").write_text(strict_json.dumps(meta, indent=2))
        # Sealed again here: the tuner checked the run's seal when it packed these files.
        seal.record(root, [f for f in folder.iterdir() if f.is_file()])
        folders.append(folder)
    return folders


# -- the actor: one per device ------------------------------------------------------------------
class TrialActor:
    """One device of the cluster: a `DevicePool` of `workers` sandbox workers sharing its lock.
    Runs no candidate code itself; judges what its workers return, as the tuner does locally."""

    def __init__(self, generation: str, gpu: bool, workers: int, packed: list[dict], limits: Limits,
                 memory_gb: float):
        import ray
        self.generation = generation
        self.device = "cuda:0" if gpu else "cpu"  # Ray made this actor's GPU its cuda:0
        self.node_id = ray.get_runtime_context().get_node_id()
        gpu_ids = ray.get_gpu_ids() if gpu else []
        # Names the device in trials: `cuda:<physical id>@<node>` or `cpu@<node>.<pid>`.
        self.label = (f"cuda:{gpu_ids[0]}@{self.node_id[:8]}" if gpu_ids else
                      f"{self.device}@{self.node_id[:8]}" if gpu else f"cpu@{self.node_id[:8]}.{os.getpid()}")
        self.root = Path(tempfile.mkdtemp(prefix=f"nightshift-ray-{generation}-"))
        # On a GPU the pool's DeviceLock names the physical GPU (through Ray's CUDA_VISIBLE_DEVICES).
        self.pool = DevicePool(self.device, unpack_problems(packed, self.root), workers=workers, limits=limits,
                               memory_gb=memory_gb, label=self.label, compile_threads=SEARCH_COMPILE_THREADS)

    def ready(self) -> dict:
        import socket
        return {"node_id": self.node_id, "pid": os.getpid(), "host": socket.gethostname(), "label": self.label,
                "generation": self.generation, "workers": len(self.pool.runners)}

    def running(self) -> dict[str, float]:
        """Candidates running on this device now: hash -> seconds since their trial started."""
        return self.pool.running()

    def run(self, candidate_json: str, candidate_path: str, screen=None) -> str:
        """`screen`: the tools.screen.ScreenBar the candidate is screened against, if any."""
        trial = self.pool.run(Candidate.model_validate_json(candidate_json), candidate_path=candidate_path,
                              screen=screen)
        trial.generation = self.generation
        return strict_json.dumps(trial)  # a NaN error read back as NaN, not None

    def interrupt(self) -> None:
        """Stop the trials running now (the tuner was interrupted); idle workers stay up."""
        self.pool.interrupt()

    def close(self) -> None:
        self.pool.close()
        shutil.rmtree(self.root, ignore_errors=True)
