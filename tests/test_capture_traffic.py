"""The routed model captures in a CUDA graph: nothing in its call copies from the host, waits for
the device or compiles (a compile inside a capture copies from the host: "Cannot copy between
CPU and CUDA tensors during CUDA graph capture", the held-out transformers model's graphed way on
the H100, 2026-12-07). Seen on the CPU by tests/host_traffic.py, on the small transformers
models with template winners routed into their attention, MLP and norm, under the Triton
interpreter, as a capture sees the call (transformers then passes its masks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agent.prompting import render_code
from tests.host_traffic import REGIONS, capturing, compiles, routed
from tools.modelfile import load_model

ROOT = Path(__file__).resolve().parents[1]
SET = ROOT / "tests" / "problems"


class Leaky(torch.nn.Module):
    """Each thing a capture refuses, one per flag."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.w = how, torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        if self.how == "copy":
            return x * torch.tensor(2.0, device=x.device)
        if self.how == "host":
            return x + torch.arange(8)
        if self.how == "sync":
            return x * float(x.sum())
        if self.how == "moved":
            return x + torch.ones(8).to(x.device)
        return x * self.w + torch.zeros(8, device=x.device)


@pytest.mark.parametrize("how, said", [("copy", "tensor(...) copies from the host"),
                                       ("host", "a host tensor (8,) meets a device tensor in add"),
                                       ("sync", "__float__() waits for the device"),
                                       ("moved", "a host tensor (8,) copied to the device by to"),
                                       ("clean", None)])
def test_the_probe_sees_each_thing_a_capture_refuses_and_nothing_else(how, said):
    model, x = Leaky(how), torch.randn(4, 8)  # the device's: made before the call
    with torch.no_grad(), capturing() as probe:
        model(x)
    if said is None:
        assert probe.found == []
    else:
        assert len(probe.found) == 1 and probe.found[0].startswith(said), probe.found
        assert "test_capture_traffic.py" in probe.found[0]  # where: the model's own line


def test_transformers_models_with_winners_routed_in_capture_clean():
    """The five small models served over transformers' StaticCache, each with a template winner in
    its MLP and norm (and its attention, where a template takes it), every workload called as a
    capture calls it: nothing copied from the host, no wait, no compile, and the answer the
    untouched model gives."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "tests.host_traffic", *REGIONS], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(said) == set(REGIONS)
    for stem, got in said.items():
        assert got["skipped"] == [] and len(got["templates"]) >= 2, (stem, got)
        assert got["compiles"] == 0, (stem, got)
        for name, w in got["workloads"].items():
            assert w["found"] == [] and w["error"] < 1e-4, (stem, name, w)


def test_a_compiled_winner_never_compiles_inside_a_capture(tmp_path):
    """torch.compile of a region (the compiler planner's winners) called first inside the capture:
    it runs the region's own code there, compiling nothing (a compile copies from the host)."""
    loaded = load_model(SET / "hf_llama.py", "cpu")
    compiled = render_code("kernels/torch_compile.py.j2", mode=None, options={})
    forward = routed(tmp_path, [("LlamaRMSNorm", compiled), ("LlamaMLP", compiled)], "routed_compiled").forward
    before = compiles()
    w = loaded.workloads[0]
    with torch.no_grad():
        want = loaded.model(*w.inputs)
        w.restore()  # the cache as the workload made it
        with capturing() as probe:
            got = forward(loaded.model, *w.inputs)
    assert compiles() == before and probe.found == []
    torch.testing.assert_close(got, want)
