"""The verdict's acceptance run on a GPU, in one device call.

    python bench/adversarial_bench.py OUT_DIR [--cpu] [--lanes=N] [--subset] [--only=a,b] [--skip-honest] [--honest-tiny] [--skip-aa] [--skip-tune]

1. the jail in force (the bench refuses to run without one) and the worker's own report of it;
2. every candidate of tests/candidates/adversarial and tests/candidates/gpu, timing ON, against
   the full-size example's RMSNorm (bf16 on a GPU; the small fp32 preset with --cpu): each must
   get one of its declared statuses; good candidates must still pass, with their speedups;
3. afterwards: the run folder and the model file byte-identical, no process a candidate started
   still alive, no secret (the tuner's API key, a canary planted in the run folder) in any output;
4. A/A: integration of the untouched model (nothing to apply) must read "no change" on every
   workload;
5. `agent tune --planner files` with cheats mixed among good candidates: only good ones kept,
   and the report shows only honest numbers.
Prints short tables last; full logs go to OUT_DIR.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CPU = "--cpu" in sys.argv
if CPU:
    os.environ.update(LLAMA_PRESET="small", LLAMA_LAYERS="1")
os.environ["ANTHROPIC_API_KEY"] = "sk-ant-bench-not-a-real-key"
CANARY = "NIGHTSHIFT-CANARY-bench"

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from sandbox.jail import describe  # noqa: E402
from sandbox.pool import DevicePool  # noqa: E402
from sandbox.runner import Limits, TrialRunner  # noqa: E402
from tools.trial import Candidate  # noqa: E402

out_dir = Path([a for a in sys.argv[1:] if not a.startswith("--")][0] if len(sys.argv) > 1 else "bench-out")
out_dir.mkdir(parents=True, exist_ok=True)
con = Console(width=200)
log = open(out_dir / "adversarial.log", "w")
DEVICE = "cpu" if CPU else "cuda:0"


def step(title: str) -> None:
    con.print(f"[bold]== {title}[/] ({time.strftime('%H:%M:%S')})")


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def expected(text: str) -> set[str]:
    found = re.search(r"EXPECT: ([\w|]+)", text).group(1)
    if not CPU and (m := re.search(r"EXPECT_GPU: ([\w|]+)", text)):
        found = m.group(1)
    return set(found.split("|"))


step("jail")
iso = describe()
con.print(f"sandbox: {iso.kind} {iso.note}")
for line in iso.isolated:
    con.print(f"  isolated: {line}")
for line in iso.not_isolated:
    con.print(f"  NOT isolated: {line}")
if iso.kind != "bubblewrap":  # these candidates signal every process they see and edit files
    con.print("refusing to run the adversarial suite without the jail: it would harm this machine")
    sys.exit(2)

step("freeze")
from agent.setup.jobs import profile_and_freeze  # noqa: E402

work = Path(tempfile.mkdtemp(prefix="nightshift-bench-"))
model = work / "model" / "llama.py"
model.parent.mkdir()
shutil.copy(ROOT / "examples" / "llama.py", model)
res = profile_and_freeze(model, "cpu" if CPU else "cuda", None, work / "runs",
                         regions=["LlamaRMSNorm", "LlamaMLP"])
run = res.run
(run.path / "secret.txt").write_text(CANARY)
before_run, before_model = digest(run.path), model.read_bytes()
con.print(f"froze {[p.name for p in res.problems]} in {run.path}")

step("candidates, timing on")
lim = Limits(compile_s=120, run_s=60, time_s=120, budget_ms=150)
LANES = int(next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--lanes=")), "1"))
# The lanes of one device pool: on a GPU they share its lock, its reference worker and its
# quiet (one times at a time, nothing else of theirs running), as a tune's lanes do.
pool = DevicePool(DEVICE, [run.problems_dir / p.name for p in res.problems], workers=LANES, limits=lim)
runner = pool.runners[0]
files = sorted((ROOT / "tests/candidates/adversarial").glob("*.py"))
if not CPU:
    files += sorted((ROOT / "tests/candidates/gpu").glob("*.py"))
# --subset: one or two of each class (the whole suite runs in CI on the CPU, with timing where it matters).
SUBSET = {"timed_call_counter", "timed_stack_inspection", "perf_counter_restored", "fakes_cuda_events",
          "fakes_events_restored", "flips_tf32", "library_slow_rsqrt", "patches_tensor_mul", "swaps_region_code",
          "setprofile_hook", "late_thread_write", "late_thread_zeroes", "late_timer_zeroes", "clone_override", "reuses_output_buffer", "gc_scrape",
          "content_cache", "cached_copy", "forges_reply", "forges_store_row", "edits_tolerance", "edits_model_file",
          "reads_parent_environ", "reads_secret_files", "setsid_grandchild", "signals_parent", "stale_memory",
          "uninitialized", "mutates_input", "side_stream", "side_stream_joined", "poisons_triton_cache",
          "oob_kernel", "allocates_forever", "cached", "queues_gpu_work_when_idle"}
SUBSET2 = {"edits_model_file", "edits_tolerance", "forges_store_row", "reads_secret_files", "setsid_grandchild",
           "signals_parent", "reads_parent_environ", "side_stream", "side_stream_joined", "poisons_triton_cache",
           "timed_call_counter", "fakes_events_restored", "queues_gpu_work_when_idle"}
if "--subset" in sys.argv:
    files = [f for f in files if f.stem in SUBSET]
ONLY = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--only=")), None)
if ONLY:
    files = [f for f in files if f.stem in ONLY]
if "--subset2" in sys.argv:  # what a first GPU run got wrong or did not reach, and the GPU-only cases
    files = [f for f in files if f.stem in SUBSET2]
good = [("LlamaRMSNorm", ROOT / "tests/candidates/rmsnorm_triton.py"),
        ("LlamaMLP", ROOT / "tests/candidates/mlp_silu_mul_triton.py")]
rows, wrong = [], []
# Candidates that hurt whatever shares the machine with them (all the GPU's memory, signals to
# the tuner, a sleep past the limit) run alone; the rest run on --lanes runners at once, which
# only matters for wall time: every verdict is still decided per trial by its own runner.
SOLO = {"allocates_forever", "signals_parent", "sleeps_forever", "oob_kernel"}


def judge_file(path: Path, lane_runner: TrialRunner) -> tuple:
    text = path.read_text()
    marker = f"ns-bench-{path.stem}"
    source = text
    for key, value in {"{reference_path}": run.problems_dir / "LlamaRMSNorm" / "reference.pt", "{port}": 9,
                       "{run_dir}": run.path, "{secret_path}": run.path / "secret.txt",
                       "{git_config}": ROOT / ".git" / "config", "{marker}": marker}.items():
        source = source.replace(key, str(value))
    want = expected(text)
    lane_runner.limits = Limits(compile_s=20, run_s=20, time_s=60, budget_ms=150) if "sleeps" in path.stem else lim
    t0 = time.time()
    trial = lane_runner.run(Candidate(region="LlamaRMSNorm", source=source), do_time=True)
    took = time.time() - t0
    lane_runner.limits = lim
    leaked = [s for s in ("sk-ant", CANARY, "[core]") if s in trial.model_dump_json()]
    alive = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    # NOT_A_WIN: right answers and a speed that is not its own; it must never read faster.
    false_win = "NOT_A_WIN" in text and trial.win
    ok = trial.status.value in want and not leaked and not alive and not false_win
    log.write(f"{path.name}: {trial.status.value} {trial.reason} (speedup {trial.speedup}, band {trial.noise_band}, "
              f"flags {trial.flags})\n{trial.error_text[-1500:]}\n\n")
    log.flush()
    return (path.parent.name + "/" + path.stem, "|".join(sorted(want)), trial.status.value,
            "yes" if ok else "NO", f"{took:.1f}",
            (f"READ AS A WIN: {trial.speedup:.2f}x, band {trial.noise_band:.3f}; " if false_win else "")
            + (trial.reason or "")[:90], ",".join(leaked), len(alive))


t_suite = time.time()
for path in [f for f in files if f.stem in SOLO]:
    rows.append(judge_file(path, runner))
shared = [f for f in files if f.stem not in SOLO]
if LANES > 1:
    from concurrent.futures import ThreadPoolExecutor
    import queue
    pool_runners: "queue.Queue[TrialRunner]" = queue.Queue()
    for lr in pool.runners:
        pool_runners.put(lr)

    def on_lane(path: Path) -> tuple:
        lr = pool_runners.get()
        try:
            return judge_file(path, lr)
        finally:
            pool_runners.put(lr)
    with ThreadPoolExecutor(LANES) as ex:
        rows += list(ex.map(on_lane, shared))
else:
    rows += [judge_file(path, runner) for path in shared]
rows.sort()
wrong = [r[0] for r in rows if r[3] != "yes"]
con.print(f"{len(rows)} candidates judged in {time.time() - t_suite:.0f} s on {LANES} lane(s)")
runner.limits = lim
speed = []
for region, path in good:
    trial = runner.run(Candidate(region=region, source=path.read_text()))
    speed.append((region, path.name, trial.status.value, trial.speedup, trial.noise_band,
                  [(t.workload, round(t.baseline_ms, 4), round(t.candidate_ms, 4), round(t.parent_ms or 0, 4),
                    t.verdict) for t in trial.timings]))
pool.close()
after_run, after_model = digest(run.path), model.read_bytes()

table = Table(title=f"adversarial suite, timing on, {DEVICE} ({iso.kind})")
for col in ("candidate", "expected", "got", "right", "s", "reason", "leaked", "left alive"):
    table.add_column(col)
for r in rows:
    table.add_row(*[str(x) for x in r])
con.print(table)
for s in speed:
    con.print(f"good {s[0]} {s[1]}: {s[2]} speedup {s[3] and round(s[3], 3)} band {s[4] and round(s[4], 4)} {s[5]}")
con.print(f"run folder byte-identical: {before_run == after_run}; model file unchanged: {before_model == after_model}")
if before_run != after_run:
    con.print(f"  changed: {sorted(set(before_run.items()) ^ set(after_run.items()))[:8]}")
con.print(f"wrong statuses: {wrong or 'none'}")

step("no false positives: own forward and plain-torch rewrites on torch's own regions and whole models")
honest = []
if "--skip-honest" not in sys.argv:
    from bench.honest_bench import honest_rows  # noqa: E402
    honest = honest_rows(work, DEVICE, lim, tiny="--honest-tiny" in sys.argv, show=con.print)

step("A/A integration of the untouched model")
aa = None
if "--skip-aa" not in sys.argv:
    from agent.review.integrate import integrate  # noqa: E402
    t0 = time.time()
    clean = run.store()  # integration takes winners from the store: none are recorded here
    clean.close()
    # Nothing to apply and no CUDA-graph capture (a real change, measured on the H200 as 3.6x on
    # decode): the tuned model is the original, so every workload must read "no change".
    aa = integrate(run, None if CPU else "cuda", baselines=False, cuda_graphs=False)
    con.print(f"integration took {time.time() - t0:.0f} s")
    if aa is not None:
        for w in aa.workloads:
            con.print(f"A/A {w.name}: eager {w.eager_ms:.4f} ms, 'tuned' {w.tuned_ms:.4f} ms, {w.speedup:.3f}x, "
                      f"band ±{w.noise_band:.3%} -> {w.verdict}")

step("agent tune --planner files, cheats among good candidates")
tune_rows = []
if "--skip-tune" not in sys.argv:
    inbox = run.inbox / "LlamaRMSNorm"
    inbox.mkdir(parents=True, exist_ok=True)
    mixed = {"good_triton.py": ROOT / "tests/candidates/rmsnorm_triton.py",
             "cheat_counter.py": ROOT / "tests/candidates/adversarial/timed_call_counter.py",
             "cheat_stack.py": ROOT / "tests/candidates/adversarial/timed_stack_inspection.py",
             "cheat_perturb.py": ROOT / "tests/candidates/adversarial/content_cache.py",
             "cheat_late.py": ROOT / "tests/candidates/adversarial/late_thread_write.py",
             "cheat_timer.py": ROOT / "tests/candidates/adversarial/patches_timer.py",
             "cheat_reply.py": ROOT / "tests/candidates/adversarial/forges_reply.py"}
    for name, src in mixed.items():
        (inbox / name).write_text(src.read_text())
    # This process still holds the GPU (freeze, integration): name it, or the tuner leaves it alone.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    t0 = time.time()
    done = subprocess.run([sys.executable, "-m", "agent", "tune", "--resume", str(run.path), "--planner", "files",
                           "--max-candidates", "20", "--no-integrate", "--json", "--devices", "cpu" if CPU else "cuda:0"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    (out_dir / "tune.log").write_text(done.stdout + "\n" + done.stderr)
    con.print(f"tune exit {done.returncode} in {time.time() - t0:.0f} s")
    store = run.store()
    for t in store.trials("LlamaRMSNorm"):
        if t.planner == "files":
            tune_rows.append((Path(t.candidate_path).name, t.status.value, t.speedup, t.noise_band, t.reason[:80]))
    store.close()
    subprocess.run([sys.executable, "-m", "agent", "report", str(run.path)], env=env, cwd=ROOT, capture_output=True)
    report = (run.path / "report.md").read_text() if (run.path / "report.md").is_file() else ""
    (out_dir / "report.md").write_text(report)

for r in tune_rows:
    con.print(f"tune --planner files: {r}")
json.dump({"honest": honest, "rows": rows, "speed": speed, "wrong": wrong, "run_identical": before_run == after_run,
           "model_identical": before_model == after_model, "tune": tune_rows,
           "aa": [w.model_dump() for w in aa.workloads] if aa else None}, open(out_dir / "adversarial.json", "w"),
          indent=1, default=str)
