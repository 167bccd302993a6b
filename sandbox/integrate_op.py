"""The worker's `integrate` op: the whole model with the winners routed in, run and timed.

Candidate code runs here, never in the tuner. One request carries everything the op needs
(model file, model state, model inputs, and the candidates as {region_class, source, hash}),
so a fresh worker can answer it; a worker that already holds the same model and candidate
set reuses them, so timing and baselines can be separate requests (each with its own time
limit, and a baseline that kills the process costs only that baseline).

What one request can ask for:
- `untouched_outputs`: the untouched model's outputs, computed before any candidate code is
  imported in this process (refused if this worker ran candidate code before);
- `run`: the tuned model on every workload, twice (fresh memory poisoned with NaN, then with
  a second pattern), outputs returned as plain tensors with their description, the number
  of calls routed through each candidate, input hashes after the call, module tensors that
  changed, and torch or harness functions that were replaced;
- `time`: untouched vs tuned per workload with `tools.timing.time_pair` (interleaved);
- `baselines`: torch.compile of the untouched model (default mode, max-autotune without CUDA
  graphs, reduce-overhead), each timed against eager with time_pair; every failure comes
  back as text under `baseline_errors`, never as a failed op.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import sys
import time
import types
from typing import Any

from sandbox import worker_tensors as T

BASELINES: dict[str, str | None] = {"torch.compile": None,
                                    "max-autotune-no-cudagraphs": "max-autotune-no-cudagraphs",
                                    "reduce-overhead": "reduce-overhead"}
"""Baseline name -> torch.compile mode (None: the default mode). Other names are passed as the mode."""


def handle(worker: Any, req: dict, _tensors: Any) -> tuple[dict, Any]:
    # The worker module as it runs (`python -m sandbox.worker` makes it __main__): its Failure
    # class is the one the serve loop catches, so it is taken from there, not imported again.
    W = sys.modules[type(worker).__module__]
    torch = worker.torch
    from tools.region import build_region, call_args

    key = (req["model_file"], req["state_path"], req["inputs_path"],
           tuple(c["hash"] for c in req.get("candidates", [])))
    header: dict[str, Any] = {"timing_kind": "cuda" if worker.device.type == "cuda" else "cpu"}
    payload: dict[str, Any] = {}
    st = getattr(worker, "integration", None)
    if st is None or st["key"] != key or req.get("untouched_outputs"):
        worker.integration = None
        t0 = time.perf_counter()
        if req.get("untouched_outputs") and worker.candidates_run:
            return {"ok": False, "status": "lost", "phase": "untouched",
                    "error": "worker has run candidate code; untouched outputs need a fresh worker"}, None
        try:  # no candidate code has run yet: a failure here is the model's, not a candidate's
            state = torch.load(req["state_path"], weights_only=True, map_location="cpu")
            inputs = torch.load(req["inputs_path"], weights_only=True, map_location="cpu")
            untouched = build_region(req["model_file"], "", state, worker.device)
            del state
            if req.get("untouched_outputs"):
                payload["untouched"] = []
                for s in inputs:
                    args, kwargs = call_args(s, worker.device)
                    with torch.no_grad():
                        payload["untouched"].append(T.plain(untouched(*args, **kwargs)))
                worker._sync()
        except BaseException as e:
            f = W.classify(e, "run")
            return {"ok": False, "status": f.status, "phase": "untouched", "fatal": f.fatal, "error": f.error}, None
        classes = sorted({type(m) for m in untouched.modules()}, key=lambda c: c.__qualname__)
        snapshot = W.integrity_snapshot(classes)
        tuned = copy.deepcopy(untouched) if req.get("candidates") else untouched
        counts: dict[str, int] = {}
        routed = {}
        for c in req.get("candidates", []):
            routed[c["region_class"]] = _route(worker, W, tuned, c, counts)
        st = {"key": key, "inputs": inputs, "untouched": untouched, "tuned": tuned, "counts": counts,
              "routed": routed, "classes": classes, "snapshot": snapshot}
        worker.integration = st
        header["build_s"] = time.perf_counter() - t0
    header["routed"] = st["routed"]
    if req.get("run"):
        header.update(_run(worker, W, st, req.get("output_bytes")))
        payload.update(header.pop("runs"))
    if req.get("time"):
        header["timings"] = _time_tuned(worker, st, req)
    if req.get("baselines"):
        header["baselines"], header["baseline_errors"] = {}, {}
        for name in req["baselines"]:
            try:
                header["baselines"][name] = _time_baseline(worker, st, name, req)
            except BaseException as e:  # never fails the op: the failure is the baseline's result
                f = W.classify(e, "run")
                header["baseline_errors"][name] = f"{type(e).__name__}: {e}"[:2000]
                if f.fatal:
                    header["spoiled"] = True  # a sticky device error: the parent replaces this worker
                    break
    now = W.integrity_snapshot(st["classes"])
    header["tampered"] = sorted(k for k, v in st["snapshot"].items() if now.get(k) != v)[:20]
    return header, payload or None


def _route(worker: Any, W: Any, tuned: Any, c: dict, counts: dict[str, int]) -> int:
    """Import one candidate from a real file and send every instance of its class through it."""
    worker.candidates_run += 1
    name = f"integrate_{c['hash']}_{worker.candidates_run}"
    path = os.path.join(worker.workdir, f"{name}.py")
    with open(path, "w") as f:
        f.write(c["source"])  # Triton reads kernel source through inspect, so it needs a file
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except BaseException as e:  # SystemExit from candidate code counts as a failure too
        raise W.classify(e, "load")
    fwd = getattr(mod, "forward", None)
    if not callable(fwd):
        raise W.Failure("compile_error", f"the candidate for {c['region_class']} defines no callable "
                        "`forward(module, *inputs)`")
    cls = c["region_class"]
    instances = [m for m in tuned.modules() if type(m).__qualname__ == cls]
    if not instances:
        raise W.Failure("runtime_error", f"the model has no module of class {cls}")
    counts.setdefault(cls, 0)

    def forward(self, *args, **kwargs):
        counts[cls] += 1
        return fwd(self, *args, **kwargs)

    for inst in instances:
        # An instance attribute wins over the class's forward, so Module.__call__ (and its
        # hooks) stays as it is and only this instance's forward changes.
        inst.forward = types.MethodType(forward, inst)
    return len(instances)


def _run(worker: Any, W: Any, st: dict, output_bytes: list[list[int]] | None) -> dict:
    torch = worker.torch
    from tools.problem import tensor_hash
    from tools.region import call_args, flatten
    tuned, counts = st["tuned"], st["counts"]
    runs: dict[str, list] = {"a": [], "b": []}
    meta, calls, input_hashes = [], [], []
    sizes = output_bytes or [[] for _ in st["inputs"]]
    for key, poison in (("a", float("nan")), ("b", 7777.0)):
        for i, s in enumerate(st["inputs"]):
            args, kwargs = call_args(s, worker.device)
            worker._poison(poison, sizes[i % len(sizes)])
            for k in counts:
                counts[k] = 0
            with T.fill_uninitialized(torch, key == "a"):
                out = worker._call(lambda: tuned(*args, **kwargs), "run")
                leaves, structure = flatten(out)
                snap = [t.clone() if isinstance(t, torch.Tensor) else None for t in leaves]
            worker._sync()
            runs[key].append([None if t is None else T.plain_tensor(t) for t in snap])
            if key == "a":
                meta.append({"structure": structure, "outputs": [T.describe(t) for t in leaves]})
                calls.append(dict(counts))
            input_hashes.append(tensor_hash({"args": args, "kwargs": kwargs}))
            del out, leaves, snap
    orig, now = T.tensors_map(st["untouched"]), T.tensors_map(tuned)
    changed = [n for n in orig if n not in now or not torch.equal(now[n], orig[n])]
    return {"runs": runs, "meta": meta, "calls": calls, "input_hashes": input_hashes, "params_changed": changed}


def _time_tuned(worker: Any, st: dict, req: dict) -> list[dict]:
    from tools.region import call_args
    from tools.timing import time_pair
    untouched, tuned, out = st["untouched"], st["tuned"], []
    for i, s in enumerate(st["inputs"]):
        a_args, a_kw = call_args(s, worker.device)
        b_args, b_kw = call_args(s, worker.device)
        with worker.torch.no_grad():
            base, cand = time_pair(lambda: untouched(*a_args, **a_kw),
                                   lambda: worker._call(lambda: tuned(*b_args, **b_kw), "run"),
                                   worker.device, budget_ms=req.get("budget_ms", 400.0),
                                   max_reps=req.get("max_reps", 200))
        out.append({"set": i, "eager": _stats(base), "tuned": _stats(cand)})
    return out


def _time_baseline(worker: Any, st: dict, name: str, req: dict) -> dict:
    """torch.compile of the untouched model in one mode, timed against eager on every workload."""
    torch = worker.torch
    from tools.region import call_args
    from tools.timing import time_pair
    untouched = st["untouched"]
    torch._dynamo.reset()
    mode = BASELINES.get(name, name)
    compiled = torch.compile(untouched, mode=mode) if mode else torch.compile(untouched)
    t0 = time.perf_counter()
    with torch.no_grad():
        for s in st["inputs"]:  # compiles (once per input shape), outside the timing
            args, kwargs = call_args(s, worker.device)
            compiled(*args, **kwargs)
    worker._sync()
    compile_s = time.perf_counter() - t0
    out = []
    for i, s in enumerate(st["inputs"]):
        a_args, a_kw = call_args(s, worker.device)
        b_args, b_kw = call_args(s, worker.device)
        with torch.no_grad():
            eager, comp = time_pair(lambda: untouched(*a_args, **a_kw), lambda: compiled(*b_args, **b_kw),
                                    worker.device, budget_ms=req.get("budget_ms", 400.0),
                                    max_reps=req.get("max_reps", 200))
        out.append({"set": i, "eager": _stats(eager), "compiled": _stats(comp)})
    return {"compile_s": compile_s, "timings": out}


def _stats(s: Any) -> dict:
    return {"median_ms": s.median_ms, "p20_ms": s.p20_ms, "p80_ms": s.p80_ms, "reps": s.reps,
            "hidden_ms": s.hidden_ms, "spread": s.spread}
