"""Device discovery, ceilings and their cache, and the doctor report (CPU only)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from agent.setup import doctor
from tools import devices
from tools.devices import Ceilings, get_ceilings, list_devices, measure_ceilings, software_versions

ROOT = Path(__file__).resolve().parent.parent
FAKE_KEY = "sk-ant-FAKE-doctor-must-not-print-this-0123456789"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NIGHTSHIFT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def counted_measure(monkeypatch):
    """Real measurements, made small, counted: the cache test needs to see re-measuring."""
    calls = []
    real = devices.measure_ceilings

    def small(device, **kwargs):
        calls.append(device)
        return real(device, copy_bytes=1 << 20, matmul_n=64, reps=2)

    monkeypatch.setattr(devices, "measure_ceilings", small)
    return calls


def test_cpu_is_always_listed_last():
    found = list_devices()
    cpu = found[-1]
    assert cpu.kind == "cpu" and cpu.generation == "cpu" and cpu.torch_device == "cpu"
    assert cpu.name and cpu.total_memory_bytes > 0
    for gpu in found[:-1]:
        assert gpu.generation.startswith(("sm", "gfx"))


def test_cpu_ceilings_are_positive_and_finite():
    c = measure_ceilings("cpu", copy_bytes=1 << 20, matmul_n=64, reps=2)
    assert c.dtype == "float32" and c.torch_version == torch.__version__
    for value in (c.bandwidth_gbps, c.matmul_tflops):
        assert math.isfinite(value) and value > 0


def test_floor_is_the_slower_of_compute_and_memory():
    c = Ceilings(device_name="x", bandwidth_gbps=1000.0, matmul_tflops=100.0, dtype="bfloat16",
                 measured_at="now")
    assert c.floor_ms(flops=1e12, nbytes=0) == pytest.approx(10.0)  # 1 TFLOP at 100 TFLOP/s
    assert c.floor_ms(flops=0, nbytes=1e9) == pytest.approx(1.0)  # 1 GB at 1000 GB/s
    assert c.floor_ms(flops=1e12, nbytes=1e9) == pytest.approx(10.0)


def test_second_call_reads_the_cache(cache_dir, counted_measure):
    first = get_ceilings("cpu")
    assert len(counted_measure) == 1
    cached = json.loads((cache_dir / "ceilings.json").read_text())
    (key,) = cached
    assert torch.__version__ in key and first.device_name in key

    second = get_ceilings("cpu")
    assert len(counted_measure) == 1, "a cached device was measured again"
    assert second == first

    get_ceilings("cpu", refresh=True)
    assert len(counted_measure) == 2


def test_corrupt_cache_is_measured_again(cache_dir, counted_measure):
    cache_dir.mkdir(parents=True)
    (cache_dir / "ceilings.json").write_text("{not json")
    get_ceilings("cpu")
    assert len(counted_measure) == 1
    assert json.loads((cache_dir / "ceilings.json").read_text())


def test_software_versions_names_the_stack():
    v = software_versions()
    assert v["torch"] == torch.__version__ and v["python"] and v["nightshift"]
    assert {"triton", "cuda", "hip"} <= set(v)


def test_doctor_reports_keys_as_set_never_their_value(cache_dir, counted_measure, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", FAKE_KEY)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    report = doctor.run_doctor()

    assert report["api_keys"] == {"ANTHROPIC_API_KEY": "set", "OPENAI_API_KEY": "unset"}
    assert FAKE_KEY not in json.dumps(report)
    console = Console(record=True, width=200)
    console.print(doctor.render_doctor(report))
    text = console.export_text()
    assert FAKE_KEY not in text and "ANTHROPIC_API_KEY" in text

    assert report["ok"] is True and report["triton"]["ok"]
    if not torch.cuda.is_available():
        assert report["triton"]["mode"] == "interpreter"
    assert report["ceilings"]["cpu"]["bandwidth_gbps"] > 0
    assert len(counted_measure) == len(report["devices"])


def test_doctor_is_not_ok_when_triton_cannot_run(monkeypatch):
    monkeypatch.setattr(doctor, "_TRITON_CHECK", "raise SystemExit('no triton backend here')")
    report = doctor.run_doctor(ceilings=False)
    assert report["ok"] is False
    assert "no triton backend here" in report["triton"]["detail"]
    assert any("Triton cannot run" in p for p in report["failures"])


def test_no_gpu_is_a_note_and_the_doctor_is_ready_without_a_failure(monkeypatch):
    """On a CPU-only machine the doctor says so, as a note: the CPU fallback is a way to run."""
    monkeypatch.setattr(doctor, "list_devices", lambda: [d for d in list_devices() if d.kind == "cpu"])
    monkeypatch.delenv("NIGHTSHIFT_NO_BWRAP", raising=False)
    report = doctor.run_doctor(ceilings=False)
    assert report["failures"] == [] and report["ok"] is True, report["failures"]
    assert any(n.startswith("no GPU visible") for n in report["notes"]), report["notes"]
    assert "problems" not in report  # one list that mixed both is gone
    console = Console(record=True, width=300)
    console.print(doctor.render_doctor(report))
    assert "note: no GPU visible" in console.export_text() and "failure" not in console.export_text()


def test_candidates_that_cannot_be_jailed_are_a_failure_and_exit_1(tmp_path):
    """`agent try` would refuse the agent's candidates here: that stops the workflow, so exit 1."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NIGHTSHIFT_NO_BWRAP": "1", "NIGHTSHIFT_CACHE": str(tmp_path)}
    env.pop("NIGHTSHIFT_NO_JAIL", None)
    result = subprocess.run([sys.executable, "-m", "agent", "doctor", "--json"], env=env, capture_output=True,
                            text=True, timeout=600)
    report = json.loads(result.stdout)
    assert result.returncode == 1 and report["ok"] is False, (result.returncode, report["failures"])
    assert any("--no-jail" in f for f in report["failures"]), report["failures"]
    env["NIGHTSHIFT_NO_JAIL"] = "1"  # the user's own choice: a note, not a failure
    result = subprocess.run([sys.executable, "-m", "agent", "doctor", "--json"], env=env, capture_output=True,
                            text=True, timeout=600)
    report = json.loads(result.stdout)
    assert result.returncode == 0 and report["ok"] is True and report["failures"] == [], report["failures"]
    assert any("not jailed" in n for n in report["notes"]), report["notes"]


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
def test_gpus_come_first_with_their_generation():
    gpu = list_devices()[0]
    assert gpu.kind in ("cuda", "rocm") and gpu.torch_device == "cuda:0"
    assert gpu.generation.startswith("sm" if gpu.kind == "cuda" else "gfx")
    assert gpu.total_memory_bytes > 0 and gpu.driver_version


@pytest.mark.gpu
@needs_gpu
def test_gpu_ceilings_are_plausible():
    c = measure_ceilings("cuda:0", copy_bytes=256 << 20, matmul_n=4096, reps=5)
    assert c.dtype == "bfloat16"
    assert 100 < c.bandwidth_gbps < 20_000 and 10 < c.matmul_tflops < 5_000


@pytest.mark.gpu
@needs_gpu
def test_triton_runs_on_the_gpu():
    check = doctor.check_triton()
    assert check["ok"] and check["mode"] == "gpu", check


def test_every_gpu_busy_with_gpu_frozen_problems_stops_with_a_clear_error(monkeypatch, tmp_path):
    """Without --devices, a tuner that finds every GPU in use must not quietly run GPU-frozen
    problems on the CPU all night (it did on the H200, while the bench's own process held it)."""
    from types import SimpleNamespace

    from agent.search import tuning
    from agent.errors import UserError
    from agent.executors.local import Slot
    from agent.search.settings import StopRule

    busy = (["cuda:0 left alone: 3.5 GiB in use by other work", "no idle GPU: using the CPU"])
    from agent.setup import jobs
    from agent.executors import local
    monkeypatch.setattr(local, "parse_devices", lambda devices: ([Slot("cpu", "cpu")], list(busy)))
    monkeypatch.setattr(jobs, "check_model_unchanged", lambda p: None)
    run = SimpleNamespace(path=tmp_path, inbox=tmp_path / "inbox", problems=lambda: [SimpleNamespace(name="LlamaRMSNorm", device="cuda")])
    with pytest.raises(UserError, match="no idle GPU .*cuda:0 left alone.*--devices cuda:0.*--devices cpu"):
        tuning.run_tune(run, "template", None, StopRule())
    # Asked for on purpose, the CPU is used (with a note), so the same setting gets past this check.
    monkeypatch.setattr(tuning, "make_planner", lambda *a, **k: (_ for _ in ()).throw(ValueError("planner reached")))
    with pytest.raises(UserError, match="planner reached"):
        tuning.run_tune(run, "template", "cpu", StopRule())


def _other_tuner_holding(acquire: str):
    """Another process that has run `acquire` (statements on DeviceLock that leave what they
    took in `held`, so it is never collected) and holds it until killed: another tuner."""
    import subprocess
    import sys
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); "
         f"from sandbox.device_lock import DeviceLock; {acquire}; print('held', flush=True); time.sleep(60)",
         str(Path(__file__).resolve().parent.parent)],
        stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_two_tuners_sharing_a_gpu_never_time_at_once(tmp_path, monkeypatch):
    """The device lock holds across processes (an flock per physical GPU): while another tuner
    holds cuda:0, this one waits; the holder's death frees it; GPUs renumbered by
    CUDA_VISIBLE_DEVICES lock the physical device, and two GPUs do not share a lock."""
    import threading
    import time
    from sandbox.device_lock import DeviceLock, physical_device
    monkeypatch.setenv("NIGHTSHIFT_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    holder = _other_tuner_holding("held = DeviceLock('cuda:0'); held.__enter__()")
    try:
        got = threading.Event()

        def take():
            with DeviceLock("cuda:0"):
                got.set()

        waiter = threading.Thread(target=take, daemon=True)
        waiter.start()
        with DeviceLock("cuda:1"):  # another GPU: not blocked
            pass
        time.sleep(1.0)
        assert not got.is_set(), "took cuda:0 while another process held it"
        holder.kill()  # a killed tuner's lock goes with it
        assert got.wait(10), "the lock of a dead process was not released"
    finally:
        holder.kill()
        holder.wait()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert physical_device("cuda:1") == "cuda-5" and physical_device("cuda:0") == "cuda-3"
    assert DeviceLock("cuda:1").path.name == "cuda-5.lock"


def test_verifications_share_the_device_and_a_timing_has_it_alone(tmp_path, monkeypatch):
    """Verifications hold the device lock shared, VERIFY_AT_ONCE at a time, in this tuner and
    beside another's; a timing waits for every one under way (in either tuner), and no new one
    starts while a timing waits."""
    import threading
    import time
    from sandbox.device_lock import VERIFY_AT_ONCE, DeviceLock
    monkeypatch.setenv("NIGHTSHIFT_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    lock = DeviceLock("cuda:0")
    events: list[str] = []

    def hold(kind: str, name: str, release: threading.Event) -> threading.Thread:
        def run():
            with (lock.verifying() if kind == "verify" else lock):
                events.append(f"{name} in")
                release.wait(10)
            events.append(f"{name} out")
        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def settle(n: int) -> None:
        deadline = time.monotonic() + 5
        while len([e for e in events if e.endswith(" in")]) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # time for anything that should not get in to get in

    assert VERIFY_AT_ONCE == 2
    go = [threading.Event() for _ in range(5)]
    threads = [hold("verify", "v1", go[0]), hold("verify", "v2", go[1])]
    settle(2)
    threads.append(hold("verify", "v3", go[2]))  # a third waits for one of the two
    settle(2)
    assert sorted(events) == ["v1 in", "v2 in"], events
    go[0].set()
    settle(3)
    assert "v3 in" in events, events
    threads.append(hold("time", "t", go[3]))  # waits for v2 and v3 ...
    time.sleep(0.2)
    threads.append(hold("verify", "v4", go[4]))  # ... and v4 waits behind it
    settle(3)
    assert "t in" not in events and "v4 in" not in events, events
    go[1].set()
    go[2].set()
    settle(4)
    assert "t in" in events and "v4 in" not in events, events
    go[3].set()
    go[4].set()
    for t in threads:
        t.join(10)
    assert events.index("v4 in") > events.index("t out"), events
    # A whole model verifies alone (the most device memory); a region's shares.
    from sandbox.device_lock import verifying
    assert verifying(lock, whole_model=True) is lock and verifying(lock) is not lock
    # Another tuner verifying: this one verifies beside it, and times only once it is gone.
    other = _other_tuner_holding("held = DeviceLock('cuda:0').verifying(); held.__enter__()")
    try:
        with lock.verifying():
            pass
        timed = threading.Event()
        t = threading.Thread(target=lambda: (lock.__enter__(), timed.set(), lock.__exit__()), daemon=True)
        t.start()
        assert not timed.wait(0.5), "timed while another tuner verified"
        other.kill()
        assert timed.wait(10), "the lock of a dead tuner's verification was not released"
    finally:
        other.kill()
        other.wait()


def test_workers_started_ahead_for_the_search_do_not_make_its_gpu_look_busy(monkeypatch):
    """The search's workers start while the model is frozen, each holding a CUDA context: the
    idle check that picks the search's GPUs afterwards must not count them as other work (three
    spares' 2.4 GiB would have sent a GPU-frozen search to 'no idle GPU')."""
    import torch

    from agent.executors import local
    from sandbox import spawn
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (140 * gib - int(3.2 * gib), 140 * gib))
    monkeypatch.setattr(local, "_generation", lambda d: "sm90")
    alive = type("P", (), {"poll": lambda self: None})()
    spares = [spawn._Launched(alive, None, "", "", {}, "cuda:0") for _ in range(3)]
    monkeypatch.setattr(spawn, "_SPARES", {("k",): spares})
    slots, notes = local.parse_devices(None)
    assert [s.device for s in slots] == ["cuda:0"], notes
    monkeypatch.setattr(spawn, "_SPARES", {})  # the same memory held by another program: busy
    slots, notes = local.parse_devices(None)
    assert [s.device for s in slots] == ["cpu"] and "left alone" in notes[0]


def test_lanes_a_gpu_are_bounded_by_cores_and_by_device_memory():
    from agent.executors.local import workers_per_gpu
    assert workers_per_gpu(16, 1) == 8            # two cores a lane, at most 8
    assert workers_per_gpu(16, 1, 79.2) == 6      # an H100: 8 lanes of the example ran out of memory
    assert workers_per_gpu(16, 1, 139.8) == 8     # an H200
    assert workers_per_gpu(16, 2, 139.8) == 4     # two GPUs share the host's cores
    assert workers_per_gpu(2, 1, 24.0) == 2       # never fewer than two
