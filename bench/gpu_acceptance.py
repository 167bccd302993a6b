"""GPU acceptance for the ground floor and the sandbox, in one device call.

    python bench/gpu_acceptance.py OUT_DIR

1. `agent doctor` report;
2. profile of the full-size example (2 layers, bf16), our hotspot table next to a plain
   torch.profiler table, and problems frozen for RMSNorm, MLP and attention;
3. one sandbox runner on cuda:0 going through good, crashing and cheating candidates in a
   row (the harness must survive each, and the next candidate still verify and time);
4. the same candidate timed five times in one run: medians and their spread.
Prints short tables last; full logs go to OUT_DIR.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402

out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "bench-out")
out_dir.mkdir(parents=True, exist_ok=True)
log = Console(file=open(out_dir / "acceptance.log", "w"), width=200)
con = Console(width=200)


def step(title: str) -> None:
    con.print(f"[bold]== {title}[/] ({time.strftime('%H:%M:%S')})")


step("doctor")
doc = subprocess.run([sys.executable, "-m", "agent", "doctor", "--json"], capture_output=True, text=True, cwd=ROOT)
report = json.loads(doc.stdout)
(out_dir / "doctor.json").write_text(doc.stdout)
for d in report["devices"]:
    c = report["ceilings"].get(d["torch_device"], {})
    con.print(f"{d['torch_device']}: {d['name']} {d['generation']} {d['total_memory_bytes'] / 2**30:.0f} GiB "
              f"driver {d['driver_version']} | copy {c.get('bandwidth_gbps', 0):.0f} GB/s, "
              f"matmul {c.get('matmul_tflops', 0):.0f} TFLOP/s")
con.print(f"triton: {report['triton']} | keys: {report['api_keys']} | exit {doc.returncode}")

step("profile full-size example")
from agent.setup.jobs import profile_and_freeze  # noqa: E402
from tools.modelfile import load_model  # noqa: E402
from tools.profiler import render_hotspots, select_regions, torch_profiler_table  # noqa: E402

t0 = time.time()
res = profile_and_freeze(ROOT / "examples/llama.py", "cuda", None, out_dir / "runs",
                         regions=["LlamaRMSNorm", "LlamaMLP", "LlamaAttention"])
con.print(f"profile + freeze took {time.time() - t0:.1f} s; auto-selected regions: "
          f"{[r.class_name for r in select_regions(res.result)]}")
for w in res.result.workloads:
    con.print(f"workload {w.name}: {w.wall_ms:.3f} ms per forward (wall), profiled device total {w.total_ms:.3f} ms")
con.print(render_hotspots(res.result, top=14))
log.print(render_hotspots(res.result, top=40))
for wl in ("prefill", "decode"):
    table = torch_profiler_table(load_model(ROOT / "examples/llama.py", "cuda"), "cuda", wl)
    (out_dir / f"torch_profiler_{wl}.txt").write_text(str(table))
    con.print(f"-- plain torch.profiler, {wl} (top rows)")
    con.print("\n".join(str(table).splitlines()[:16]), markup=False, highlight=False)

step("sandbox on cuda:0")
from sandbox.runner import Limits, TrialRunner  # noqa: E402
from tools.trial import Candidate  # noqa: E402

problems = res.run.problems_dir
runner = TrialRunner("cuda:0", Limits())
for name in ("LlamaRMSNorm", "LlamaMLP"):
    runner.add_problem(problems / name)
C = ROOT / "tests/candidates"
seq = [("LlamaRMSNorm", C / "rmsnorm_triton.py"), ("LlamaMLP", C / "mlp_silu_mul_triton.py"),
       ("LlamaRMSNorm", C / "gpu/oob_kernel.py"), ("LlamaRMSNorm", C / "rmsnorm_triton.py"),
       ("LlamaRMSNorm", C / "gpu/side_stream.py"), ("LlamaRMSNorm", C / "gpu/side_stream_joined.py"),
       ("LlamaMLP", C / "mlp_silu_mul_triton.py")]
seq += [("LlamaRMSNorm", C / "adversarial" / f"{n}.py") for n in
        ("uninitialized", "stale_memory", "cached", "patches_timer", "mutates_input", "allocates_forever",
         "sleeps_forever")]
rows = []
for region, path in seq:
    src = path.read_text().replace("{reference_path}", str(problems / region / "reference.pt"))
    limits = runner.limits
    runner.limits = Limits(compile_s=20, run_s=20) if "sleeps" in path.name else Limits()
    t = runner.run(Candidate(region=region, source=src))
    runner.limits = limits
    rows.append((region, path.name, t))
    log.print(path.name, t.model_dump_json(indent=1))
con.print(f"{'region':<14} {'candidate':<26} {'status':<16} {'error':>9} {'tol':>12} "
          f"{'prefill':>22} {'decode':>22} {'small_batch':>22} reason")
for region, name, t in rows:
    tim = {x.workload: f"{x.baseline_ms:.4f}/{x.candidate_ms:.4f} {x.speedup:.2f}x" for x in t.timings}
    err = f"{t.error:.2g}" if t.error is not None else "-"
    con.print(f"{region:<14} {name:<26} {t.status.value:<16} {err:>9} {t.tolerance:>12} "
              f"{tim.get('prefill', '-'):>22} {tim.get('decode', '-'):>22} {tim.get('small_batch', '-'):>22} "
              f"{t.reason[:70]} {'; '.join(t.flags)}", markup=False, highlight=False)

step("repeatability: the MLP candidate timed five times in one run")
src = (C / "mlp_silu_mul_triton.py").read_text()
meds: dict[str, list[float]] = {}
for i in range(5):
    t = runner.run(Candidate(region="LlamaMLP", source=src))
    for x in t.timings:
        meds.setdefault(x.workload, []).append(x.candidate_ms)
        meds.setdefault(x.workload + " (baseline)", []).append(x.baseline_ms)
for k, v in meds.items():
    spread = (max(v) - min(v)) / statistics.median(v)
    con.print(f"{k:<26} medians {' '.join(f'{m:.4f}' for m in v)} ms  max-min spread {spread:.1%}")
runner.close()
con.print(f"run folder {res.run.path}")
