"""The sandbox workers: the only processes where candidate code runs, and the reference
workers, which never run any.

Started by `sandbox.client.Worker` as `python -m sandbox.worker --role ...`, pinned to one
device, inside the jail of `sandbox/jail.py` where the machine allows one. Both roles register
problems (the region rebuilt from the model file and the frozen state, which arrive as file
descriptors) and answer requests over a socket (`protocol`):

- a *reference* worker runs only the original region: the outputs for fresh inputs and for
  perturbed parameters (`refs`), and timed runs of the original (`batch`), which also show
  the tuner what the harness's own work around the calls costs. The tuner trusts these
  numbers, so this process never imports candidate code (`load` is refused);
- a *candidate* worker imports one candidate at a time (`load`), runs the verification calls
  (`verify`, then `verify_outputs` ships what they returned), and runs timed batches whose
  outputs the tuner samples afterwards (`batch`, `kept`).

What the candidate can reach is said in sandbox/jail.py. What it can do inside its own process
is anything: patch torch, this module, the timer. So nothing it reports is taken on trust:
outputs are judged by the tuner against references this process never holds; the baseline is
timed in the reference worker; a candidate batch's claimed time is bounded by the tuner's
clock; the integrity snapshot (sandbox/integrity.py) is a second line that names the tampering.
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

_T_STARTED = time.perf_counter()
from sandbox import integrity, isolation, protocol  # noqa: E402 (torch: the imports' seconds are counted)
from sandbox import worker_tensors as T  # noqa: E402
from sandbox.integrity import COMPUTE_OPS  # noqa: E402

_T_IMPORTED = time.perf_counter()

FATAL_CUDA = ("illegal memory access", "device-side assert", "unspecified launch failure",
              "CUDA error", "misaligned address", "CUBLAS_STATUS_EXECUTION_FAILED", "HIP error")
BASE_SETS = 4
"""Frozen input sets a worker keeps on its device for timed runs (a workload's runs use one)."""
ANSWERS = 8
"""Timed runs' kept answers the reference worker holds (one output each, on the device): a
spot check fetches its answer once its workload's timing has let the device lock go, and
another runner's three rounds may come first (an answer dropped is computed again)."""


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


class Worker:
    def __init__(self, sock: socket.socket, device_kind: str, role: str):
        import torch
        from tools.timing import CudaClock
        self.torch, self.sock, self.role = torch, sock, role
        self.device = torch.device("cuda:0" if device_kind == "cuda" else "cpu")
        self.clock = CudaClock(self.device) if self.device.type == "cuda" else None
        self.problems: dict[str, dict] = {}
        self.candidate: dict | None = None
        self.candidates_run = 0
        self.workdir = os.getcwd()
        self.snapshot: dict[str, Any] = {}
        self.classes: list[type] = []
        self.verified: tuple | None = None
        """What the last verification runs saw, until `op_verify_outputs` sends it."""
        self.dynamo_before: dict = {}
        """dynamo's counters when the loaded candidate was imported (`op_compiled` reports the change)."""
        self.names_compile = False
        """The loaded candidate's source names torch.compile or dynamo."""
        self.in_place: dict[tuple, Any] = {}
        """(problem, input set, control) -> the timed runs' inputs written in place, kept at one address."""
        self.kept: list = []
        """Output copies of the last candidate batch, until the tuner picks its sample."""
        self.answers: dict[int, tuple] = {}
        """The reference worker's: one repetition's output of its recent timed runs, by the run's
        seed (`keep_index`, drawn by the tuner and never sent to the candidate's worker): the
        answer a spot check compares with, without running the original again."""
        self.snapshots: dict[tuple, Any] = {}
        """(problem, input set) -> the last timed run's output copies there (`_snapshots`)."""
        self.base_sets: dict[tuple, tuple] = {}
        """(problem, input set) -> that frozen set on the device, for timed runs (`_base_set`)."""

    # -- both roles ----------------------------------------------------------------------
    def op_problem(self, req: dict, _: Any) -> tuple[dict, Any]:
        """Register a problem: the region rebuilt from the model file and the frozen state."""
        from tools.modelfile import import_model_file
        from tools.objects import as_called
        from tools.region import build_region, seeded
        if self.candidates_run:
            return {"ok": False, "error": "this worker has run candidate code; problems need a fresh worker"}, None
        fds = req.get("_fds") or []
        if len(fds) != 3:
            return {"ok": False, "error": "expected the inputs, state and model files"}, None
        t0 = time.perf_counter()
        inputs, state = load_fd(fds[0]), load_fd(fds[1])
        with os.fdopen(fds[2], "rb") as f:
            model_source = f.read()
        os.environ.update(isolation.model_settings(req.get("env") or {}))
        t1 = time.perf_counter()
        model_copy = self._model_copy(req["model_file"], model_source)
        import_model_file(model_copy, origin=req["model_file"])  # once per model file; timed apart from the build
        t2 = time.perf_counter()
        region = build_region(model_copy, req["region_path"], state, self.device, on_meta=bool(req.get("meta", True)))
        del state
        parts = {"files": t1 - t0, "import": t2 - t1, "build": time.perf_counter() - t2}
        # A region drawing random numbers is called seeded, the original and candidates alike
        # (tools.region.CALL_SEED); timed runs too, so both sides pay for the seeding.
        # Cache objects in the inputs (transformers' KV caches, frozen as plain data) are rebuilt
        # at each call around the set's own tensors (tools/objects.py), the original's and candidates'.
        wrap = (lambda f: as_called(seeded(f))) if req.get("seeded") else as_called
        self.problems[req["name"]] = {"region": region, "forward": wrap(type(region).forward), "inputs": inputs,
                                      "wrap": wrap, "fixed_ints": bool(req.get("fixed_ints"))}
        header: dict[str, Any] = {"ok": True, "parts": parts}
        payload = None
        if self.role == "reference":
            from sandbox import reference_runs
            header["effects"], payload = reference_runs.original_effects(self, self.problems[req["name"]])
        self.classes = sorted({type(m) for p in self.problems.values() for m in p["region"].modules()},
                              key=lambda c: f"{c.__module__}.{c.__qualname__}")
        self.snapshot = integrity.snapshot(self.classes, list(COMPUTE_OPS))
        return header, payload

    def op_batch(self, req: dict, _: Any) -> tuple[dict, Any]:
        """Timed repetitions on fresh inputs drawn from frozen set `set` with `seed`: the original
        (reference worker; `control`: the original in the candidate's worker) or the candidate.
        Both sides copy and checksum every output, so their runs differ only in their calls."""
        from tools.timing import run_batch
        name = req["problem"] if self.role == "reference" else self._loaded()[0]["problem"]
        p = self.problems[name]
        t_up = time.perf_counter()
        base_args, base_kwargs = self._base_set(p, name, req["set"])
        upload_ms = (time.perf_counter() - t_up) * 1e3
        seed = int(req["seed"])
        # One cache address per input set for the worker's whole life with this candidate, not
        # per run: with a few repetitions a run (slow calls), a new address each run made
        # reduce-overhead re-record its CUDA graphs in half of its timed calls.
        make = self.in_place.setdefault((req.get("problem"), req["set"], bool(req.get("control"))),
                                        T.WrittenInPlace(None))
        make.draw = lambda j: T.fresh_set(p, base_args, base_kwargs, seed + 1000003 * j)
        if self.role == "reference" or req.get("control"):
            region, fwd = p["region"], p["forward"]
            call = lambda a: fwd(region, *a[0], **a[1])  # noqa: E731
        else:
            fwd, module = self.candidate["forward"], self.candidate["module"]
            # The same call path as the original's above: a wrapper here would be timed as the candidate's.
            call = lambda a: fwd(module, *a[0], **a[1])  # noqa: E731
        keep: bool | set[int] = self.role == "candidate" and not req.get("control")
        if self.role == "reference" and isinstance(req.get("keep_index"), int):
            keep = {req["keep_index"]}
        self.kept = []
        with self.torch.no_grad():
            try:
                snaps = self._snapshots((req.get("problem"), req["set"]), int(req["reps"]))
                got = run_batch(call, make, int(req["reps"]), self.device, self.clock,
                                lead_cycles=float(req.get("lead_cycles", 0)),
                                copy_out=lambda out: self._copy_outputs(out, snaps),
                                keep=keep, seed=seed, key_len=int(req.get("key_len", 1)))
            except Failure:
                raise
            except BaseException as e:
                raise classify(e, "run")
        kept = got.pop("kept")
        self.kept = kept if keep is True else []
        if isinstance(keep, set) and kept:
            snaps.give_up(keep)
            self.answers.pop(seed, None)
            self.answers[seed] = kept[0]
            while len(self.answers) > ANSWERS:  # rounds that were not spot-checked
                self.answers.pop(next(iter(self.answers)))
        # No integrity check here: the tuner's clock around this request is compared with the
        # original's run of the same shape, so it must do the same work and nothing more.
        return {**got, "timing_kind": "cuda" if self.clock else "cpu", "upload_ms": upload_ms,
                "cycles_per_ms": self.clock.cycles_per_ms if self.clock else 0.0}, None

    def tampered(self) -> list[str]:
        """What candidate code changed since the snapshot (sandbox/integrity.py), by name."""
        return integrity.changed(self.snapshot, self.classes, list(COMPUTE_OPS))

    def op_integrity(self, req: dict, _: Any) -> tuple[dict, Any]:
        return {"tampered": self.tampered()}, None

    # -- reference role ------------------------------------------------------------------
    def op_refs(self, req: dict, _: Any) -> tuple[dict, Any]:
        if self.role != "reference":
            return {"ok": False, "error": "refs are computed by the reference worker only"}, None
        from sandbox import reference_runs
        return reference_runs.refs(self, req)

    # -- candidate role ------------------------------------------------------------------
    def op_load(self, req: dict, _: Any) -> tuple[dict, Any]:
        if self.role != "candidate":
            return {"ok": False, "error": "the reference worker never runs candidate code"}, None
        self.release()
        self.candidates_run += 1
        self.dynamo_before = {}
        self.names_compile = any(w in req["source"] for w in ("torch.compile", "_dynamo"))
        if "torch._dynamo" in sys.modules:  # counters are per process: the probe reports this candidate's
            from sandbox import compiled
            self.dynamo_before = compiled.counters()
        p = self.problems[req["problem"]]
        path = os.path.join(self.workdir, f"candidate_{req['hash']}.py")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(req["source"])  # Triton reads kernel source through inspect, so it needs a file
        os.replace(tmp, path)
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
        fwd = p["wrap"](fwd)
        self.candidate = {"forward": fwd, "module": module, "problem": req["problem"]}
        # First calls compile (Triton, torch.compile) once per input shape: under the compile
        # timeout, before any verification or timing. Code that uses torch.compile gets a second
        # round: reduce-overhead records its CUDA graphs on a later call than it compiles, and a
        # routed model compiled after one eager call compiled its first shape in verification,
        # under the device lock (10-61 s a way on the H200, against 0.3 s for a plain compile).
        for _ in range(2 if self.names_compile else 1):
            for i in range(len(p["inputs"])):
                args, kwargs = self._device_set(p, i)
                self._call(lambda: fwd(module, *args, **kwargs), "warm")
        self._sync()
        return {"ok": True, "compile_s": time.perf_counter() - t0,
                "tampered": self.tampered()}, None

    def op_compiled(self, req: dict, _: Any) -> tuple[dict, Any]:
        """How the loaded candidate really runs under torch.compile, if it uses it: dynamo's
        counters since its load, and one profiled call per frozen input set counting compiled
        regions entered and compute ops run outside them (a frame dynamo skipped runs eager)."""
        if "torch._dynamo" not in sys.modules:
            return {"dynamo": None}, None
        from sandbox import compiled
        if self.dynamo_before and not self.names_compile and not any(
                v - self.dynamo_before.get(k, 0) for k, v in compiled.counters().items()):
            # dynamo came with an earlier candidate in this worker, and this one neither names
            # torch.compile nor made dynamo see a frame (a frame dynamo skips counts nothing)
            return {"dynamo": None}, None
        c, p = self._loaded()
        calls = []
        for i in range(len(p["inputs"])):
            args, kwargs = self._device_set(p, i)
            calls.append(lambda a=args, k=kwargs: c["forward"](c["module"], *a, **k))
        with self.torch.no_grad():
            try:
                return {"dynamo": compiled.probe(calls, self.dynamo_before)}, None
            except BaseException as e:
                raise classify(e, "run")

    def op_verify(self, req: dict, _: Any) -> tuple[dict, Any]:
        from sandbox import verify_runs
        return verify_runs.run(self, req)

    def op_verify_outputs(self, req: dict, _: Any) -> tuple[dict, Any]:
        from sandbox import verify_runs
        return verify_runs.outputs(self)

    def op_kept(self, req: dict, _: Any) -> tuple[dict, Any]:
        """The output copies of the last batch's repetitions the tuner picked, then none; in the
        reference worker, the answer kept from the timed run of `seed` (none if it was dropped)."""
        if self.role == "reference":
            got = self.answers.pop(req.get("seed"), None)
            return {"meta": [None if got is None else got[1]]}, {
                "outputs": [None if got is None else [None if t is None else T.plain_tensor(t) for t in got[0]]]}
        picked = []
        for i in req.get("indices", []):
            got = self.kept[i] if isinstance(i, int) and 0 <= i < len(self.kept) else None
            picked.append(None if got is None else [None if t is None else T.plain_tensor(t) for t in got[0]])
        meta = [None if not (isinstance(i, int) and 0 <= i < len(self.kept)) else self.kept[i][1]
                for i in req.get("indices", [])]
        self.kept = []
        return {"meta": meta}, {"outputs": picked}

    # -- helpers ---------------------------------------------------------------------------
    def _model_copy(self, original: str, source: bytes) -> str:
        """The model file as the tuner sent it, written into this worker's own folder (its folder
        may not be readable here; where it is, it serves sibling imports: import_model_file)."""
        import hashlib
        folder = os.path.join(self.workdir, "model-" + hashlib.sha256(source).hexdigest()[:16])
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, os.path.basename(original))
        if not os.path.exists(path):
            with open(path + ".tmp", "wb") as f:
                f.write(source)
            os.replace(path + ".tmp", path)
        return path

    def _loaded(self) -> tuple[dict, dict]:
        if self.candidate is None:
            raise Failure("crash", "no candidate is loaded")
        return self.candidate, self.problems[self.candidate["problem"]]

    def _device_set(self, p: dict, i: int) -> tuple[list, dict]:
        from tools.region import call_args
        return call_args(p["inputs"][i], self.device)

    def _draw_base(self, p: dict, i: int) -> tuple[list, dict]:
        """Frozen input set `i` on the device, to draw fresh inputs from, never passed to a call:
        on the CPU the frozen tensors themselves (a copy of each is 256 MB of fresh pages a draw
        for a KernelBench softmax)."""
        if self.device.type == "cpu":
            return list(p["inputs"][i]["args"]), dict(p["inputs"][i]["kwargs"])
        return self._device_set(p, i)

    def _base_set(self, p: dict, name: str, i: int) -> tuple[list, dict]:
        """Frozen input set `i` on the device for timed runs, copied there once (the most recent
        BASE_SETS kept): each repetition draws fresh inputs from it and never writes it. A copy
        from host memory per run (half a gigabyte for a decode KV cache) was most of a timed
        run's wall time, and its jitter between two workers outgrew a decode kernel."""
        key = (name, i)
        got = self.base_sets.pop(key, None) or self._draw_base(p, i)
        self.base_sets[key] = got  # the most recent last
        while len(self.base_sets) > BASE_SETS:
            self.base_sets.pop(next(iter(self.base_sets)))
        return got

    def _snapshots(self, key: tuple, reps: int) -> "T.Snapshots":
        """Where a timed run copies its outputs: on the CPU the copies of the last run of the same
        input set, the control's too (their pages are faulted in once per candidate, on both sides
        alike; what a run kept is fetched before the next one); on a GPU new ones (its caching
        allocator hands the same blocks back anyway)."""
        if self.device.type != "cpu":
            return T.Snapshots(reps)
        snaps = self.snapshots.setdefault(key, T.Snapshots(reps))
        snaps.rewind(reps)
        return snaps

    def _copy_outputs(self, out: Any, snaps: "T.Snapshots") -> tuple[list, dict]:
        """Stream-ordered private copies of an output, and what it looked like, right after the
        call's end event: what the tuner later checks is what the call had produced."""
        from tools.region import flatten
        leaves, structure = flatten(out)
        copies = snaps.take(leaves)
        return copies, {"structure": structure, "outputs": [T.describe(t) for t in leaves]}

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

    def release(self) -> None:
        # The device copies of inputs go too: the next candidate must not meet ones this one touched.
        self.candidate, self.verified, self.kept, self.in_place, self.base_sets = None, None, [], {}, {}
        self.snapshots = {}
        gc.collect()
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()

    def serve(self) -> None:
        handlers = {"problem": self.op_problem, "load": self.op_load, "verify": self.op_verify,
                    "verify_outputs": self.op_verify_outputs, "batch": self.op_batch, "kept": self.op_kept,
                    "refs": self.op_refs, "integrity": self.op_integrity,
                    "compiled": self.op_compiled}
        while True:
            try:
                req, tensors = protocol.recv(self.sock, accept_fds=True)
            except protocol.ChannelClosed:
                return
            op, nonce = req.get("op"), req.get("nonce")
            if op == "exit":
                return
            if op == "release":
                self.release()
                protocol.send(self.sock, {"ok": True, "nonce": nonce})
                continue
            try:
                if op not in handlers:
                    raise Failure("crash", f"unknown request {op!r}")
                header, payload = handlers[op](req, tensors)
            except BaseException as e:
                f = e if isinstance(e, Failure) else classify(e, "run")
                protocol.send(self.sock, {"ok": False, "status": f.status, "error": f.error, "fatal": f.fatal,
                                          "nonce": nonce})
                if f.fatal:
                    os._exit(3)  # a sticky device error spoils the process: the parent starts a new one
                continue
            try:
                protocol.send(self.sock, {"ok": True, **header, "nonce": nonce}, payload)
            except (TypeError, ValueError) as e:  # an answer that cannot be encoded is a failure
                protocol.send(self.sock, {"ok": False, "status": "crash", "error": f"unsendable reply: {e}",
                                          "nonce": nonce})


def load_fd(fd: int) -> Any:
    """torch.load of a file the tuner opened for this worker (its path may be hidden here),
    memory-mapped through /proc/self/fd: pages are read as a tensor is touched and shared with
    every other worker holding the same problems (a KV cache is half a gigabyte a workload).
    Where the file cannot be reopened that way (a user that may not open it), read whole."""
    import torch
    try:
        got = torch.load(f"/proc/self/fd/{fd}", weights_only=True, map_location="cpu", mmap=True)
    except (OSError, RuntimeError, ValueError):
        with os.fdopen(fd, "rb") as f:
            return torch.load(f, weights_only=True, map_location="cpu")
    os.close(fd)
    return got


def arguments() -> argparse.ArgumentParser:
    """The worker's command line (the fork server takes the same: sandbox/forkserver.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--role", choices=["candidate", "reference"], default="candidate")
    ap.add_argument("--jailed", action="store_true")
    ap.add_argument("--memory-gb", type=float, default=0)
    ap.add_argument("--gpu-memory-fraction", type=float, default=0.9)
    ap.add_argument("--preload", action="append", default=[], help="a model file whose library imports to load early")
    return ap


def main() -> None:
    args = arguments().parse_args()
    report = {"parent_death": "bubblewrap (--die-with-parent)" if args.jailed else isolation.die_with_parent(args.parent),
              "user": isolation.drop_privileges() if args.jailed else "same user as the tuner",
              "network": "empty namespace (bubblewrap)" if args.jailed else isolation.drop_network()}
    mem = int(args.memory_gb * (1 << 30)) if args.memory_gb and args.device == "cpu" else None
    report["limits"] = isolation.limit_resources(mem)
    run(args, report, socket.socket(fileno=args.fd), {"imports": _T_IMPORTED - _T_STARTED})


def run(args: argparse.Namespace, report: dict, sock: socket.socket, parts: dict[str, float],
        preloaded: bool = False) -> None:
    """The worker from its imports on: the device, the hello, then requests until told to exit.
    `parts`: seconds already spent (the imports; a forked worker's fork); `preloaded`: the model
    file's libraries are imported already (the fork server did it)."""
    t_setup = time.perf_counter()
    import torch
    import torch.utils.deterministic  # noqa: F401
    t_torch = time.perf_counter()
    # torch._dynamo is not imported here (seconds of every start): a candidate's torch.compile
    # imports it, and the integrity check knows the wrappers that import installs (integrity.py).
    hello = {"op": "hello", "pid": os.getpid(), "isolation": report, "device": args.device, "role": args.role,
             "torch": torch.__version__}
    if args.device == "cuda":
        if not torch.cuda.is_available():
            protocol.send(sock, {**hello, "ok": False, "error": "CUDA is not available in the worker"})
            return
        torch.cuda.set_per_process_memory_fraction(args.gpu_memory_fraction)
        props = torch.cuda.get_device_properties(0)
        hello.update(device_name=props.name, generation=f"sm{props.major}{props.minor}")
    else:
        # One thread: two workers (candidate and reference) share the cores, and an OpenMP barrier
        # waiting on a preempted thread turns a 0.04 ms call into a 7 ms one at random.
        torch.set_num_threads(1)
        hello.update(device_name="cpu", generation="cpu")
    t_device = time.perf_counter()
    try:  # a reference worker runs no kernel of ours: Triton (a fifth of a CPU start) loads if the model asks
        if args.role == "reference":
            from importlib.metadata import version
            hello["triton"] = version("triton")
        else:
            import triton
            hello["triton"] = triton.__version__
    except Exception as e:
        hello["triton"] = f"unavailable ({e})"
    # Where a start's seconds go, in the worker's own account (the tuner adds what it saw).
    hello["parts"] = {**parts, "setup": t_torch - t_setup, "device": t_device - t_torch,
                      "triton": time.perf_counter() - t_device}
    worker = Worker(sock, args.device, args.role)
    protocol.send(sock, {**hello, "ok": True})
    # The model file's libraries (transformers: seconds) load now, before any request: in a
    # worker started ahead of the search that is while the model is still being frozen.
    from tools.modelfile import preload_imports
    for path in [] if preloaded else args.preload:
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
        except OSError:
            continue
        preload_imports(source, os.path.dirname(path))
    worker.serve()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
