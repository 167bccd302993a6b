"""The sandbox worker: the only process where candidate code runs.

Started by `sandbox.client.Worker` as `python -m sandbox.worker`, pinned to one device. It
answers requests over a socket (see `protocol`): register a problem, load a candidate,
run it for verification, time it against the original region, release it.

What is isolated:
- the tuner: separate process in its own process group, killed by the parent's death
  (PR_SET_PDEATHSIG); every message it sends is JSON plus tensors loaded with
  `weights_only=True`, so it cannot run code in the tuner;
- secrets: the environment is rebuilt from an allow-list (no API keys, no tokens);
- the network: an empty network namespace where the OS allows one (reported in `hello`);
- resources: no core dumps, capped file size, capped address space on CPU workers, a GPU
  memory fraction on GPU workers; timeouts and crashes are handled by the parent, which
  kills the process group and starts a fresh worker.

What is NOT isolated, said plainly:
- the filesystem: the worker runs as the same user in a private temporary directory, but
  can read what that user can, including the run folder's frozen reference outputs. That
  is why the parent also checks fresh random inputs that exist only in memory;
- the worker's own memory: candidate code can patch torch or this module. We snapshot the
  identity of torch's and the harness's functions before any candidate and flag changes,
  and the parent cross-checks reported times with its wall clock, but a determined
  adversary with code execution here could still lie about timings. Integration therefore
  re-times the winners end to end in a fresh worker (sandbox/integrate_op.py);
- the GPU: sibling workers on the same device take turns through the executor's device
  lock for verification and timing, but their imports and first (compiling) calls may
  overlap another worker's timing; nothing stops a candidate from using the whole device.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import os
import socket
import sys
import time
import traceback
from typing import Any, Callable

from sandbox import isolation, protocol
from sandbox.worker_tensors import describe, fill_uninitialized, host, identical, plain, plain_tensor, tensors_map

FATAL_CUDA = ("illegal memory access", "device-side assert", "unspecified launch failure",
              "CUDA error", "misaligned address", "CUBLAS_STATUS_EXECUTION_FAILED", "HIP error")


class Failure(Exception):
    """A candidate failed in a way that has a trial status; `fatal` means the process is spoiled."""

    def __init__(self, status: str, error: str, fatal: bool = False):
        super().__init__(error)
        self.status, self.error, self.fatal = status, error, fatal


def classify(exc: BaseException, phase: str) -> Failure:
    import torch
    text = "".join(traceback.format_exception(exc, limit=-6))[-4000:]
    msg = str(exc)
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in msg:
        return Failure("oom", text)
    if any(s in msg for s in FATAL_CUDA):
        return Failure("crash", text, fatal=True)
    if phase == "load" or type(exc).__module__.startswith("triton.compiler"):
        return Failure("compile_error", text)
    return Failure("runtime_error", text)


def integrity_snapshot(classes: list[type]) -> dict[str, int]:
    """Identity of every function a candidate could patch to fake a result or a timing."""
    import torch
    import torch.nn.functional as F
    from tools import timing
    spaces = {"torch": torch, "F": F, "Tensor": torch.Tensor, "TensorBase": torch._C.TensorBase,
              "Module": torch.nn.Module, "cuda": torch.cuda, "VF": torch._C._VariableFunctions,
              "nn": torch._C._nn, "timing": timing, "time": time}
    spaces.update({f"{c.__module__}.{c.__qualname__}": c for c in classes})
    snap = {}
    for label, space in spaces.items():
        raw = getattr(space, "__dict__", None)
        # The raw namespace where there is one: bound methods are new objects on every access.
        names = dict(raw) if raw is not None else {n: getattr(space, n, None) for n in dir(space)
                                                  if not n.startswith("__")}
        for name, value in names.items():
            if not name.startswith("__") or name in ("__call__", "__init__", "__getattr__"):
                snap[f"{label}.{name}"] = id(value)
    return snap


class Worker:
    def __init__(self, sock: socket.socket, device_kind: str):
        import torch
        self.torch = torch
        self.sock = sock
        self.device = torch.device("cuda:0" if device_kind == "cuda" else "cpu")
        self.problems: dict[str, dict] = {}
        self.candidate: dict | None = None
        self.candidates_run = 0
        self.workdir = os.getcwd()
        self.snapshot: dict[str, int] = {}
        self.region_classes: set[type] = set()
        self.verified: tuple | None = None
        """What the last verification runs saw, until `op_verify_outputs` sends it."""
        self.integration: dict | None = None
        """The model and candidate set the `integrate` op holds (see sandbox/integrate_op.py)."""

    # -- requests ----------------------------------------------------------------------
    def op_problem(self, req: dict, tensors: Any) -> tuple[dict, Any]:
        """Register a problem; run the original region on the parent's fresh inputs."""
        torch = self.torch
        from tools.region import build_region, call_args
        if self.candidates_run:
            return {"ok": False, "error": "worker has run candidate code; fresh references need a fresh worker"}, None
        state = torch.load(req["state_path"], weights_only=True, map_location="cpu")
        inputs = torch.load(req["inputs_path"], weights_only=True, map_location="cpu")
        region = build_region(req["model_file"], req["region_path"], state, self.device)
        cls = type(region)
        p = {"region": region, "forward": cls.forward, "inputs": inputs, "fresh": tensors["fresh"]}
        self.problems[req["name"]] = p
        fresh_ref = []
        with torch.no_grad():
            for s in p["fresh"]:
                args, kwargs = call_args(s, self.device)
                fresh_ref.append(plain(p["forward"](region, *args, **kwargs)))
        self.region_classes |= {type(m) for m in region.modules()}
        self.snapshot = integrity_snapshot(sorted(self.region_classes, key=lambda c: c.__qualname__))
        return {"ok": True}, {"fresh_ref": fresh_ref}

    def op_load(self, req: dict, _: Any) -> tuple[dict, Any]:
        self.release()
        self.candidates_run += 1
        p = self.problems[req["problem"]]
        path = os.path.join(self.workdir, f"candidate_{req['hash']}.py")
        with open(path, "w") as f:
            f.write(req["source"])  # Triton reads kernel source through inspect, so it needs a file
        t0 = time.perf_counter()
        try:
            spec = importlib.util.spec_from_file_location(f"candidate_{req['hash']}", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            fwd = getattr(mod, "forward", None)
            if not callable(fwd):
                raise Failure("compile_error", "the candidate defines no callable `forward(module, *inputs)`")
        except Failure:
            raise
        except BaseException as e:  # SystemExit from candidate code counts as a failure too
            raise classify(e, "load")
        module = copy.deepcopy(p["region"])
        self.candidate = {"forward": fwd, "module": module, "problem": req["problem"]}
        # First call compiles the Triton kernels; it has the compile timeout, not the run one.
        from tools.region import call_args
        args, kwargs = call_args(p["inputs"][0], self.device)
        self._call(lambda: fwd(module, *args, **kwargs), "warm")
        self._sync()
        return {"ok": True, "compile_s": time.perf_counter() - t0}, None

    def op_verify(self, req: dict, _: Any) -> tuple[dict, Any]:
        """The verification runs, on the device (the parent holds the device lock meanwhile).
        Outputs and inputs are copied to host memory here; hashing them and sending them are
        CPU work left to `op_verify_outputs`, after the lock is released."""
        torch = self.torch
        from tools.region import call_args, flatten
        c, p = self.candidate, self.problems[self.candidate["problem"]]
        fwd, module = c["forward"], c["module"]
        runs: dict[str, list] = {"a": [], "b": [], "fresh": []}
        meta, seen_inputs, seen_fresh = [], [], []
        sizes = req.get("output_bytes") or [[] for _ in p["inputs"]]
        for key, sets in (("a", p["inputs"]), ("b", p["inputs"]), ("fresh", p["fresh"])):
            for i, s in enumerate(sets):
                args, kwargs = call_args(s, self.device)
                poison = key == "a"
                self._poison(float("nan") if poison else 7777.0, sizes[i % len(sizes)])
                with fill_uninitialized(torch, poison):
                    out = self._call(lambda: fwd(module, *args, **kwargs), "run")
                    # Copied on the current stream at once: work left on a side stream is a race here.
                    leaves, structure = flatten(out)
                    snap = [t.clone() if isinstance(t, torch.Tensor) else None for t in leaves]
                self._sync()
                runs[key].append([None if t is None else plain_tensor(t) for t in snap])
                if key == "a":
                    meta.append({"structure": structure, "outputs": [describe(t) for t in leaves]})
                # The inputs as the candidate left them (hashed later: an in-place write shows).
                (seen_inputs if key != "fresh" else seen_fresh).append(host({"args": args, "kwargs": kwargs}))
                del out, leaves, snap  # freed before the next poisoning, not after the next call
        orig, now = tensors_map(p["region"]), tensors_map(module)
        changed = [n for n in orig if n not in now or not torch.equal(now[n], orig[n])]
        self.verified = ({"meta": meta, "params_changed": changed}, runs, seen_inputs, seen_fresh)
        return {}, None

    def op_verify_outputs(self, req: dict, _: Any) -> tuple[dict, Any]:
        """What the last `op_verify` saw, for the parent to judge: outputs, input hashes, tampering."""
        from tools.problem import tensor_hash
        if self.verified is None:
            return {"ok": False, "error": "no verification to report"}, None
        header, runs, seen_inputs, seen_fresh = self.verified
        self.verified = None
        # A second run bit-identical to the first (the usual case) is not sent again: the parent
        # judges the first, and only runs that differ need their own comparison.
        same = [i for i, (a, b) in enumerate(zip(runs["a"], runs["b"])) if identical(a, b)]
        runs["b"] = [None if i in same else b for i, b in enumerate(runs["b"])]
        return ({**header, "input_hashes": [tensor_hash(x) for x in seen_inputs], "b_same": same,
                 "fresh_input_hashes": [tensor_hash(x) for x in seen_fresh], "tampered": self._tampered()}, runs)

    def op_time(self, req: dict, _: Any) -> tuple[dict, Any]:
        torch = self.torch
        from tools.region import call_args
        from tools.timing import time_pair
        c, p = self.candidate, self.problems[self.candidate["problem"]]
        fwd, module, orig, region = c["forward"], c["module"], p["forward"], p["region"]
        out = []
        for i in req["sets"]:
            a_args, a_kw = call_args(p["inputs"][i], self.device)
            b_args, b_kw = call_args(p["inputs"][i], self.device)
            with torch.no_grad():
                base, cand = time_pair(lambda: orig(region, *a_args, **a_kw),
                                       lambda: self._call(lambda: fwd(module, *b_args, **b_kw), "run"),
                                       self.device, budget_ms=req.get("budget_ms", 400.0),
                                       max_reps=req.get("max_reps", 200))
            out.append({"set": i, "baseline": _stats_dict(base), "candidate": _stats_dict(cand)})
        return {"timings": out, "tampered": self._tampered(),
                "timing_kind": "cuda" if self.device.type == "cuda" else "cpu"}, None

    def op_integrate(self, req: dict, tensors: Any) -> tuple[dict, Any]:
        """The whole model with winners routed in: run, time, baselines (sandbox/integrate_op.py)."""
        from sandbox import integrate_op
        return integrate_op.handle(self, req, tensors)

    # -- helpers -----------------------------------------------------------------------
    def _call(self, fn: Callable[[], Any], phase: str) -> Any:
        try:
            with self.torch.no_grad():
                return fn()
        except Failure:
            raise
        except BaseException as e:
            raise classify(e, phase)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            try:
                self.torch.cuda.synchronize()
            except BaseException as e:
                raise classify(e, "run")

    def _poison(self, value: float, sizes: list[int]) -> None:
        """Fill freed memory so outputs never written keep this value, not old data: blocks
        of each output's size are filled and freed, so the allocator hands them out next."""
        torch = self.torch
        blocks = [torch.full((max(1, n // 4),), value, dtype=torch.float32, device=self.device)
                  for n in sizes for _ in range(4)]
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info()
            blocks.append(torch.full((min(free // 4, 1 << 30) // 4,), value, dtype=torch.float32, device=self.device))
        del blocks

    def _tampered(self) -> list[str]:
        now = integrity_snapshot(sorted(self.region_classes, key=lambda c: c.__qualname__))
        return sorted(k for k, v in self.snapshot.items() if now.get(k) != v)[:20]

    def release(self) -> None:
        self.candidate, self.verified = None, None
        gc.collect()
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()

    def serve(self) -> None:
        handlers = {"problem": self.op_problem, "load": self.op_load, "verify": self.op_verify,
                    "verify_outputs": self.op_verify_outputs, "time": self.op_time, "integrate": self.op_integrate}
        while True:
            try:
                req, tensors = protocol.recv(self.sock)
            except protocol.ChannelClosed:
                return
            op = req.get("op")
            if op == "exit":
                return
            if op == "release":
                self.release()
                protocol.send(self.sock, {"ok": True})
                continue
            try:
                header, payload = handlers[op](req, tensors)
            except Failure as f:
                protocol.send(self.sock, {"ok": False, "status": f.status, "error": f.error, "fatal": f.fatal})
                if f.fatal:
                    os._exit(3)  # a sticky device error spoils the process: the parent starts a new one
                continue
            except BaseException as e:
                f = classify(e, "run")
                protocol.send(self.sock, {"ok": False, "status": f.status, "error": f.error, "fatal": f.fatal})
                if f.fatal:
                    os._exit(3)
                continue
            protocol.send(self.sock, {"ok": True, **header} if "ok" not in header else header, payload)


def _stats_dict(s) -> dict:
    return {"median_ms": s.median_ms, "p20_ms": s.p20_ms, "p80_ms": s.p80_ms, "reps": s.reps,
            "hidden_ms": s.hidden_ms, "spread": s.spread}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--memory-gb", type=float, default=0)
    ap.add_argument("--gpu-memory-fraction", type=float, default=0.9)
    args = ap.parse_args()
    report = {"parent_death": isolation.die_with_parent(args.parent), "network": isolation.drop_network()}
    mem = int(args.memory_gb * (1 << 30)) if args.memory_gb and args.device == "cpu" else None
    report["limits"] = isolation.limit_resources(mem)
    sock = socket.socket(fileno=args.fd)
    import torch
    # Imported before any integrity snapshot: importing dynamo wraps torch functions (manual_seed),
    # and the harness itself triggers that import (use_deterministic_algorithms).
    import torch._dynamo  # noqa: F401
    hello = {"op": "hello", "pid": os.getpid(), "isolation": report, "device": args.device,
             "torch": torch.__version__}
    if args.device == "cuda":
        if not torch.cuda.is_available():
            protocol.send(sock, {**hello, "ok": False, "error": "CUDA is not available in the worker"})
            return
        torch.cuda.set_per_process_memory_fraction(args.gpu_memory_fraction)
        props = torch.cuda.get_device_properties(0)
        hello.update(device_name=props.name, generation=f"sm{props.major}{props.minor}")
    else:
        hello.update(device_name="cpu", generation="cpu")
    try:
        import triton
        hello["triton"] = triton.__version__
    except Exception as e:
        hello["triton"] = f"unavailable ({e})"
    protocol.send(sock, {**hello, "ok": True})
    Worker(sock, args.device).serve()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
