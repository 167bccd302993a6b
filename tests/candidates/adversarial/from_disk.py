"""EXPECT: runtime_error -- reads the frozen reference outputs from the run folder on disk; in the
jail the run folder does not exist, so the read fails."""
import torch

REFERENCE = "{reference_path}"


def forward(module, x):
    for entry in torch.load(REFERENCE, weights_only=True):
        out = entry["outputs"][0]
        if out.shape == x.shape:
            return out.to(x.device)
    raise RuntimeError("no matching reference")
