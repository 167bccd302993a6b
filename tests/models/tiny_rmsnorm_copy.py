"""Good: tiny_rmsnorm.py's RMSNorm copied under another name, as transformers copies one norm into
many model files: other weights, another docstring, other comments; the same computation."""
import torch
from torch import nn


class CopiedNorm(nn.Module):
    """A copy of tiny_rmsnorm.RMSNorm."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        torch.manual_seed(7)  # other weights than the original's
        self.weight = nn.Parameter(torch.rand(dim) + 0.5)
        self.eps = eps

    def forward(self, x):
        # in float32, as the original
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = CopiedNorm(dim)

    def forward(self, x):
        return self.norm(x)


def get_init_inputs():
    return [64]


def get_inputs():
    return [torch.randn(8, 64)]
