"""The verification calls of a loaded candidate, in its worker (the `verify` op), and what is
sent back for the tuner to judge (`verify_outputs`).

Per frozen input set: a first call with fresh memory poisoned with NaN, a second with a
finite sentinel (an output never written keeps one or the other); then one call per fresh
input set drawn from the tuner's seed, and one call on a copy of the region whose parameters
were moved by the tuner's seed (the reference worker computes the original's answers for
both; this process never sees them). After each call, at once:

- every output is copied through the dispatcher (`worker_tensors.snap`), so what is judged is
  what the call returned, not what a thread or another stream writes there later; the output
  itself stays alive to the end of the verification and is compared with its copy after every
  later call and at the end, once every thread running the candidate's code has ended (one
  still running, or a timer still pending, after LATE_THREAD_WAIT_S is itself a late write);
- its type (a plain torch.Tensor only), layout, `requires_grad`, and whether it shares memory
  with the call's inputs, the module's tensors or an earlier output are recorded;
- the inputs and the module's tensors are compared with what they were.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from typing import Any

from sandbox import worker_tensors as T

LATE_THREAD_WAIT_S = 0.5
"""How long the end of a verification waits for threads running candidate code to end."""
CPU_REUSED_BYTES = 32 << 20
"""The largest block glibc's malloc may hand out again from memory freed earlier (its mmap
threshold's ceiling on 64-bit): larger ones come fresh from the kernel, zeroed."""


def run(w: Any, req: dict) -> tuple[dict, Any]:
    torch = w.torch
    from tools.region import flatten
    c, p = w._loaded()
    fwd, module = c["forward"], c["module"]
    n = len(p["inputs"])
    sizes = req.get("output_bytes") or [[] for _ in range(n)]
    runs: dict[str, Any] = {"a": [], "b": [], "fresh": [], "perturbed": []}
    meta: dict[str, Any] = {"a": [], "b": [], "fresh": [], "perturbed": []}
    post_inputs: list[Any] = []
    mutated: dict[str, list[int]] = {"frozen": [], "fresh": []}
    late: list[str] = []
    # Every call's outputs and copies stay alive to the end: a thread may write them much later.
    pending: list[tuple[str, list, list]] = []
    param_spans = T.spans_of(list(T.tensors_map(module).values()))

    def check_late(last: int | None = None) -> None:
        w._sync()
        for label, leaves, copies in pending[-last if last else 0:]:
            if label not in late and any(cp is not None and not T.same_bits(t, cp) for t, cp in zip(leaves, copies)):
                late.append(label)

    def call(label: str, mod: Any, args: list, kwargs: dict, poison: float | None, size: list[int]) -> None:
        key = label.split()[0]
        if poison is not None:
            _poison(w, poison, size)
        in_spans = T.spans_of([args, kwargs])
        earlier = [T.span(t) for _, leaves, _ in pending for t in leaves if isinstance(t, torch.Tensor)]
        fill = contextlib.nullcontext()
        if poison is not None and w.device.type == "cpu":
            fill = T.fill_uninitialized(torch) if math.isnan(poison) else T.fill_sentinel(torch)
        with fill:
            out = w._call(lambda: fwd(mod, *args, **kwargs), "run")
            # Copied on the current stream at once: work left on a side stream is a race here.
            leaves, structure = flatten(out)
            copies = [T.snap(t) if T.is_plain(t) else None for t in leaves]
        w._sync()
        desc = [T.describe(t) for t in leaves]
        for d, t in zip(desc, leaves):
            if d.get("kind") == "tensor" and t.numel():
                d["aliases"] = {"input": T.shares_memory(t, in_spans), "param": T.shares_memory(t, param_spans),
                                "earlier": T.shares_memory(t, earlier)}
        runs[key].append([None if cp is None else T.plain_tensor(cp) for cp in copies])
        meta[key].append({"structure": structure, "outputs": desc})
        pending.append((label, leaves, copies))
        check_late(last=3)  # the latest calls now (cheap), every call at the end

    with torch.no_grad():
        for i in range(n):
            args, kwargs = w._device_set(p, i)
            call(f"a {i}", module, args, kwargs, float("nan"), sizes[i])
            # Compared where the inputs live: host copies of a KV cache cost seconds a call.
            if T.changed_from({"args": args, "kwargs": kwargs}, p["inputs"][i]):
                mutated["frozen"].append(i)
            post_inputs.append(T.host({"args": args, "kwargs": kwargs}) if req.get("effects", [False] * n)[i] else None)
            args, kwargs = w._device_set(p, i)
            call(f"b {i}", module, args, kwargs, T.SENTINEL, sizes[i])
            if T.changed_from({"args": args, "kwargs": kwargs}, p["inputs"][i]) and i not in mutated["frozen"]:
                mutated["frozen"].append(i)
        for item in req.get("fresh", []):
            base = w._draw_base(p, item["set"])
            args, kwargs = T.fresh_set(p, *base, int(item["seed"]))
            call(f"fresh {item['set']}", module, args, kwargs, None, [])
            again = T.fresh_set(p, *base, int(item["seed"]))
            if T.changed_from([args, kwargs], [again[0], again[1]]):
                mutated["fresh"].append(item["set"])
        moved: list[str] = []
        if req.get("perturb"):
            # The perturbed values written into the very tensors the candidate has used (as an
            # optimizer step or load_state_dict would), then put back: a candidate that kept a copy
            # of a weight from an earlier call answers with the old one here.
            spec = req["perturb"]
            want = T.tensors_map(T.perturbed(p["region"], int(spec["seed"])))
            own = T.tensors_map(module)
            saved = {n: T.snap(t) for n, t in own.items() if n in want}
            for n in saved:
                own[n].copy_(want[n])
            try:
                for i in spec["sets"]:
                    call(f"perturbed {i}", module, *w._device_set(p, i), None, [])
                w._sync()
                moved = [n for n in saved if not T.same_bits(own[n], want[n])]
            finally:
                for n, t in saved.items():
                    own[n].copy_(t)
        running = _wait_for_candidate_threads(w.workdir, LATE_THREAD_WAIT_S)
        check_late()
        late += [f"(a thread still running the candidate's code after its calls returned: {name})" for name in running]
        pending.clear()
    changed = _module_changes(torch, p["region"], module)
    changed += [f"(while perturbed) {n_}" for n_ in moved]
    header = {"meta": meta, "params_changed": changed, "mutated": mutated, "late_writes": late,
              "tampered": w.tampered()}
    w.verified = (header, runs, post_inputs)
    return {}, None


def _wait_for_candidate_threads(workdir: str, timeout: float) -> list[str]:
    """Wait until no thread runs candidate code; the names of those still running after `timeout`."""
    deadline = time.monotonic() + timeout
    while (running := _candidate_threads(workdir)) and time.monotonic() < deadline:
        time.sleep(0.005)
    return running


def _candidate_threads(workdir: str) -> list[str]:
    """Threads that run candidate code: a frame from a candidate's file (the worker writes each
    into its working folder as candidate_<hash>.py) or from no file (exec'd text), or a pending threading.Timer (which
    runs no candidate frame until it fires). Idle pools and the libraries' own threads are not."""
    frames = sys._current_frames()
    found = []
    for t in threading.enumerate():
        if t in (threading.main_thread(), threading.current_thread()) or t.ident not in frames or not t.is_alive():
            continue
        f, files = frames[t.ident], []
        while f is not None:
            files.append(f.f_code.co_filename)
            f = f.f_back
        own = [n for n in files if os.path.dirname(n) == workdir and os.path.basename(n).startswith("candidate_")
               or not (n.startswith("<frozen ") or os.path.isfile(n))]
        if own or isinstance(t, threading.Timer):
            found.append(f"{t.name} in {os.path.basename(own[0])}" if own else f"{t.name}, a pending timer")
    return found


def outputs(w: Any) -> tuple[dict, Any]:
    """What the last `verify` saw, for the tuner to judge. A second call bit-identical to the
    first (the usual case) is not sent again."""
    if w.verified is None:
        return {"ok": False, "error": "no verification to report"}, None
    header, runs, post_inputs = w.verified
    w.verified = None
    same = [i for i, (a, b) in enumerate(zip(runs["a"], runs["b"])) if T.identical(a, b)]
    runs["b"] = [None if i in same else b for i, b in enumerate(runs["b"])]
    # Code that writes late may still run here: the tuner replaces this worker (sandbox/client.py).
    retire = {"replace_worker": True} if header["late_writes"] else {}
    return {**header, "b_same": same, **retire}, {**runs, "post_inputs": post_inputs}


def _module_changes(torch, pristine: Any, used: Any) -> list[str]:
    orig, now = T.tensors_map(pristine), T.tensors_map(used)
    return [n for n in orig if n not in now or now[n].shape != orig[n].shape or not T.same_bits(now[n], orig[n])]


def _poison(w: Any, value: float, sizes: list[int]) -> None:
    """Fill freed memory so outputs never written keep this value, not old data: blocks of
    each output's size are filled and freed, so the allocator hands them out next."""
    torch = w.torch
    # On the CPU, blocks this large are mapped fresh and unmapped when freed (glibc), so they are
    # never handed out again: only smaller ones are poisoned there (the fill switches cover the rest).
    most = CPU_REUSED_BYTES if w.device.type == "cpu" else None
    blocks = [torch.full((max(1, n // 4),), value, dtype=torch.float32, device=w.device)
              for n in sizes if most is None or n <= most for _ in range(4)]
    if w.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info()
        blocks.append(torch.full((min(free // 4, 1 << 30) // 4,), value, dtype=torch.float32, device=w.device))
    del blocks
