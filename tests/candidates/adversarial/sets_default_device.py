"""EXPECT: suspicious -- changes torch's default device for the whole process at import: every
tensor the original creates without naming a device (a mask, a position table) lands on the
meta device, while the candidate's own calls are wrapped back onto the real one."""
import torch

_real = torch.get_default_device()
torch.set_default_device("meta")


def forward(module, x):
    with torch.device(_real):
        return type(module).forward(module, x)
