"""torch.compile inside our harness against torch.compile as a plain script, per workload and mode.

    python bench/compile_truth.py OUT_DIR [--model examples/llama.py] [--device cuda]
        [--modes torch.compile,max-autotune-no-cudagraphs,reduce-overhead] [--reps 30]
        [--from-run RUN]   # take the harness side from RUN's integration.json instead
        [--standalone-only] [--standalone-json FILE]   # one side now, the table later

`--standalone-only` runs the standalone side alone (beside an `agent tune` that integrates with
baselines, say: both time under the device lock) and writes OUT_DIR/standalone.json; then
`--from-run RUN --standalone-json OUT_DIR/standalone.json` prints the table without the GPU.

Harness side: the model frozen (`runs/<run>/model`), each mode a compile candidate of the whole
model, verified and timed against eager side by side in its sandbox worker, exactly as
`agent integrate --baselines` does (with its A/A noise band and dynamo's counters). Standalone
side: one fresh process per mode, `torch.compile(model, mode=...)` of the model file's own
model on its own workload inputs, CUDA events (perf_counter on the CPU), median of `--reps`
after warm-up, eager and compiled interleaved, the band from eager's own repeated medians.
Every way compiles at once, then times alone under the host's device lock
(sandbox/device_lock.py), so no timing shares the GPU.

On a GPU the standalone side times two ways: each call alone (its inputs restored from the
host, a synchronize after it, the GPU idle at the next one's start: a user who waits on every
call, whose host's launches show wherever they are slower than the GPU) and queued (calls back
to back, inputs restored from a copy on the device and the L2 flushed before each, one event pair
around each: how the harness times a whole model). On the H100 (2026-12-06) the queued column
still restored from the host, which waits for the GPU before each call: it read every short
workload 0.4-0.8 ms slower than the harness, eager and compiled alike, as the per-call one did.

Prints one table: per workload and mode, the harness's speedup over eager with its band, the
standalone speedups with their bands, and whether each agrees (the ratio of the two within the
larger band plus the other's). Exits 0 when every row agrees with the standalone timed as the
harness times (the queued one on a GPU). Writes OUT_DIR/compile_truth.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STANDALONE = r'''
import json, os, statistics, sys, time
sys.path.insert(0, {root!r})
import torch
from sandbox.device_lock import DeviceLock
from tools.modelfile import load_model, tensors_in

mode, device, reps = {mode!r}, {device!r}, {reps}
loaded = load_model({model!r}, device, check_forward=False)
model = loaded.model
compiled = torch.compile(model, **({{"mode": mode}} if mode else {{}}))
cuda = device.startswith("cuda")
if not cuda:
    torch.set_num_threads(1)  # as the sandbox's CPU workers run


def once(fn, w):
    w.restore()
    if cuda:
        torch.compiler.cudagraph_mark_step_begin() if mode == "reduce-overhead" else None
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(*w.inputs); b.record(); torch.cuda.synchronize()
        return a.elapsed_time(b)
    t = time.perf_counter(); fn(*w.inputs); return (time.perf_counter() - t) * 1e3


def device_restore(w):
    """Undo what a call wrote into w's inputs from a copy kept on the device: w.restore() copies
    from the host's pageable memory, which waits for the GPU to finish, so no call would queue
    behind another (the harness draws its inputs on the device)."""
    kept = first.get(w.name)
    if kept is None:
        w.restore()
        kept = first[w.name] = [t.clone() for t in tensors_in(w.inputs)]
    for now, before in zip(tensors_in(w.inputs), kept):
        now.copy_(before)


def queued(fn, w, n):
    """n calls queued back to back as the harness times a whole model (tools/timing.run_batch):
    the inputs restored on the device and the L2 flushed before each, one event pair around each
    call, one synchronize at the end."""
    pairs = []
    for _ in range(n):
        device_restore(w) if w.pristine is not None else None
        flush.zero_()
        torch.compiler.cudagraph_mark_step_begin() if mode == "reduce-overhead" else None
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(*w.inputs); b.record()
        pairs.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in pairs)


def summary(rounds):
    eager = statistics.median(r[0] for r in rounds)
    comp = statistics.median(r[1] for r in rounds)
    ratios = [r[0] / r[1] for r in rounds]
    return {{"eager_ms": eager, "compiled_ms": comp, "speedup": eager / comp,
            "band": (max(ratios) - min(ratios)) / 2 / (eager / comp)}}


first = {{}}
if cuda:
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (64 << 20)
    flush = torch.empty(2 * l2, dtype=torch.int8, device=device)
t0 = time.monotonic()
with torch.no_grad():
    for w in loaded.workloads:  # compile (and capture) every shape before the lock is taken
        for _ in range(3):
            once(compiled, w)
    compile_s = time.monotonic() - t0
    out = {{}}
    from sandbox.compiled import probe
    ran = probe([lambda w=w: once(compiled, w) for w in loaded.workloads], {{}})["graphs_run"]  # which graph each runs
    with DeviceLock(device if cuda else "cpu"):
        for w in loaded.workloads:
            for _ in range(3):
                once(model, w); once(compiled, w)
            rounds = []
            for _ in range(3):  # three rounds of interleaved medians: their spread is the band
                e, c = [], []
                for _ in range(reps):
                    e.append(once(model, w)); c.append(once(compiled, w))
                rounds.append((statistics.median(e), statistics.median(c)))
            out[w.name] = summary(rounds)
            out[w.name]["graphs_run"] = ran[loaded.workloads.index(w)]
            if cuda:  # and timed as the harness times: three rounds of each, queued, alternating
                out[w.name]["queued"] = summary([(queued(model, w, reps), queued(compiled, w, reps))
                                                 for _ in range(3)])
print("RESULT " + json.dumps({{"compile_s": compile_s, "workloads": out}}))
'''


def standalone(model: Path, device: str, mode: str | None, reps: int) -> subprocess.Popen:
    code = STANDALONE.format(root=str(ROOT), mode=mode, device=device, reps=reps, model=str(model))
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def collect(procs: dict[str, subprocess.Popen]) -> dict:
    theirs = {}
    for n, p in procs.items():
        stdout, stderr = p.communicate()
        line = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
        theirs[n] = json.loads(line[-1][7:]) if line else {"error": stderr[-1500:]}
    return theirs


def harness(run_path: Path, device: str, names: list[str]) -> dict:
    """The harness's compile baselines, through integration's own path (agent/review/integrate.py)."""
    from agent.review.integrate import integrate
    res = integrate(run_path, device, baselines=True, modes=names, cuda_graphs=False,
                    on_step=lambda line: print(f"  harness: {line}", flush=True))
    return harness_from(res)


def harness_from(res) -> dict:
    out: dict = {}
    for i, w in enumerate(res.workloads):
        for name, sp in w.baseline_speedups.items():
            if name.startswith("nightshift"):
                continue
            # The way's own band where recorded (its worker's noise), else the tuned model's: a
            # noisy tuned model must not widen a compile mode's band until every row "agrees".
            band = (getattr(w, "baseline_bands", {}) or {}).get(name) or w.noise_band
            ran = ((getattr(res, "dynamo", {}) or {}).get(name) or {}).get("graphs_run") or []
            out.setdefault(name, {})[w.name] = {"speedup": sp, "band": band, "ms": w.baselines.get(name),
                                                "eager_ms": w.eager_ms, "graphs_run": ran[i] if i < len(ran) else None}
    out["_fallbacks"] = res.baseline_fallbacks
    out["_dynamo"] = res.dynamo
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", type=Path, default=ROOT / "examples" / "llama.py")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--modes", default="torch.compile,max-autotune-no-cudagraphs,reduce-overhead")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--from-run", type=Path, default=None)
    ap.add_argument("--standalone-only", action="store_true")
    ap.add_argument("--standalone-json", type=Path, default=None)
    args = ap.parse_args()
    from agent.review.ways import BASELINES
    names = [n for n in args.modes.split(",") if n]
    unknown = [n for n in names if n not in BASELINES]
    if unknown:
        print(f"error: unknown mode(s) {', '.join(unknown)} (known: {', '.join(BASELINES)})", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    # Standalone processes compile while the harness freezes and compiles; each times under the lock.
    procs = {} if args.standalone_json else {
        n: standalone(args.model, args.device, BASELINES[n], args.reps) for n in names}
    if args.standalone_only:
        theirs = collect(procs)
        (args.out / "standalone.json").write_text(json.dumps(theirs, indent=2))
        for n, got in theirs.items():
            print(n, json.dumps(got.get("workloads") or got)[:600])
        return 0
    if args.from_run:
        from tools.e2e import IntegrationResult
        res = IntegrationResult.load(args.from_run)
        if res is None:
            print(f"error: {args.from_run} has no integration.json", file=sys.stderr)
            return 2
        ours = harness_from(res)
    else:
        from agent.setup.jobs import profile_and_freeze
        frozen = profile_and_freeze(args.model, args.device, None, args.out / "runs", max_regions=1)
        print(f"  frozen in {time.monotonic() - t0:.0f}s: {frozen.run.path}", flush=True)
        ours = harness(frozen.run.path, args.device, names)
    theirs = json.loads(args.standalone_json.read_text()) if args.standalone_json else collect(procs)
    rows = []
    print(f"\ncompile truth: harness vs standalone torch.compile, speedup over eager ({args.device}, "
          f"{time.monotonic() - t0:.0f}s)")
    print(f"{'workload':14} {'mode':28} {'harness':>16} {'standalone':>16} {'agree':>6} {'queued':>16} "
          f"{'agree':>6}  graphs run (harness | script)  harness fallback")
    for n in names:
        theirs.setdefault(n, {"error": "not measured"})
        if "error" in theirs[n]:
            print(f"{'':14} {n:28} standalone failed: {theirs[n]['error'].strip().splitlines()[-1:]}")
        for w, s in theirs[n].get("workloads", {}).items():
            h = ours.get(n, {}).get(w) or next((v.get(w) for k, v in ours.items() if k.startswith(n + " (")), None)
            fb = next((why for k, why in ours["_fallbacks"].items() if k.startswith(n + " (")), "")
            q = s.get("queued")
            agree, agree_q = _agree(h, s), _agree(h, q)
            rows.append({"workload": w, "mode": n, "harness": h, "standalone": s, "agree": agree,
                         "agree_queued": agree_q, "fallback": fb})
            graphs = f"{_graphs(h)} | {_graphs(s)}"
            print(f"{w:14} {n:28} {_fmt(h):>16} {_fmt(s):>16} {_yes(agree):>6} {_fmt(q):>16} {_yes(agree_q):>6}  "
                  f"{graphs:29}  {fb}")
    (args.out / "compile_truth.json").write_text(json.dumps({"rows": rows, "dynamo": ours["_dynamo"],
                                                             "standalone": theirs}, indent=2, default=str))
    return 0 if rows and all(r["agree_queued"] if r["standalone"].get("queued") else r["agree"] for r in rows) else 1


def _graphs(x: dict | None) -> str:
    """The compiled graphs ("frame/compile") a workload's call ran, "?" where not recorded."""
    ran = (x or {}).get("graphs_run")
    return "?" if ran is None else ",".join(ran) or "none"


def _agree(h: dict | None, s: dict | None) -> bool | None:
    """The two speedups' ratio within the larger band plus the other's; None where one is missing."""
    if not h or h.get("speedup") is None or not s:
        return None
    return abs(h["speedup"] / s["speedup"] - 1) <= max(h["band"], s["band"]) + min(h["band"], s["band"])


def _fmt(x: dict | None) -> str:
    return "-" if not x or x.get("speedup") is None else f"{x['speedup']:.2f}x ±{x['band']:.1%}"


def _yes(agree: bool | None) -> str:
    return "-" if agree is None else "yes" if agree else "NO"


if __name__ == "__main__":
    sys.exit(main())
