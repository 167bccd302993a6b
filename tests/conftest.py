"""Shared fixtures: a frozen run of the small example model, made once per test session."""

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "llama.py"


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
