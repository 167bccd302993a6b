"""Good: a tiny model whose only hot region is an RMSNorm (fast to tune on the CPU)."""
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim) + 0.5)
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = RMSNorm(dim)

    def forward(self, x):
        return self.norm(x)


def get_init_inputs():
    return [64]


def get_inputs():
    return [torch.randn(8, 64)]
