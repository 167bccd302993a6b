"""Shared fixtures: a frozen run of the small example model, made once per test session; the
lock that lets a timing verdict run with nothing beside it when the suite runs in several
processes (pytest-xdist); and the rule that hostile candidates run only in the jail."""

import fcntl
import inspect
import os
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "llama.py"
# Inductor on the CPU first builds and loads test programs for each vector ISA the CPU reports,
# once per cache folder, and every sandbox worker has a fresh one: about 6 of a small model's 10 s
# compile. The suite trusts what the CPU reports (the setting reaches workers and subprocesses).
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")


@pytest.fixture(scope="session")
def small_env():
    """The example's small preset, fp32 on the CPU (Triton's interpreter mishandles bf16)."""
    old = {k: os.environ.get(k) for k in ("LLAMA_PRESET", "LLAMA_LAYERS")}
    os.environ.update(LLAMA_PRESET="small", LLAMA_LAYERS="1")
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def frozen_run(tmp_path_factory, small_env):
    """Problems for LlamaRMSNorm, LlamaMLP and LlamaAttention of the small example."""
    from tools.capture import RegionChoice, freeze
    from tools.modelfile import load_model
    folder = tmp_path_factory.mktemp("run") / "problems"
    loaded = load_model(EXAMPLE, "cpu")
    problems, skipped = freeze(loaded, [RegionChoice(c) for c in ("LlamaRMSNorm", "LlamaMLP", "LlamaAttention")],
                               folder, torch.device("cpu"))
    assert not skipped, skipped
    return folder


# The suite runs in two processes on CI's two cores (addopts). A test that reads a timing verdict
# on the CPU (`@pytest.mark.alone`: an A/A "no change", a cheat that must not read faster) must
# not have the other process's load beside it: it takes the lock file exclusively, every other
# test takes it shared, from setup to teardown. The turnstile keeps a waiting exclusive test from
# being starved by the other process's stream of shared ones.
def _locks() -> tuple[Path, Path] | None:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        return None  # one process: nothing runs beside anything
    base = Path(tempfile.gettempdir()) / f"nightshift-tests-{run}"
    return base.with_suffix(".lock"), base.with_suffix(".turnstile")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    paths = _locks()
    if paths is None:
        yield
        return
    alone = item.get_closest_marker("alone") is not None
    lock = open(paths[0], "a")
    try:
        with open(paths[1], "a") as turnstile:
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield
    finally:
        lock.close()  # closing drops the lock


def pytest_sessionfinish(session, exitstatus):
    """Each test process removes the lock files when it is done: a process still running after
    the other has finished has nothing beside it to be kept from."""
    paths = _locks()
    for path in paths or ():
        path.unlink(missing_ok=True)


def pytest_collection_modifyitems(config, items):
    """A test that runs tests/candidates/adversarial (they signal every process they see, read
    secrets, edit files) is skipped, saying why, where no jail can run: it would harm the host."""
    from sandbox.jail import describe
    iso = describe()
    if iso.kind == "bubblewrap":
        return
    skip = pytest.mark.skip(reason=f"runs hostile candidates and no jail can run here ({iso.note}); agent doctor "
                                   "says how to enable one")
    for item in items:
        fn = getattr(item, "function", None)
        try:
            source = inspect.getsource(fn) if fn is not None else ""
        except (OSError, TypeError):
            source = ""
        if "candidates/adversarial" in source or '"adversarial"' in source:
            item.add_marker(skip)
