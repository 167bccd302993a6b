"""Good: two stacked blocks, each an RMSNorm and a Linear with a residual, so the RMSNorm
region appears twice (integration must route both instances through a winner)."""
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


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.proj = nn.Linear(dim, dim, bias=False)
        with torch.no_grad():  # close to the identity, so an error in a norm carries to the output
            self.proj.weight.copy_(torch.eye(dim) + 0.01 * torch.randn(dim, dim))

    def forward(self, x):
        return x + self.proj(self.norm(x))


class Model(nn.Module):
    def __init__(self, dim, layers=2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.register_buffer("scale", torch.tensor(1.0), persistent=False)  # not in state_dict()

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x * self.scale


def get_init_inputs():
    return [64]


def get_inputs():
    return [torch.randn(8, 64)]


def get_workloads():
    return {"rows8": {"inputs": [torch.randn(8, 64)], "weight": 1.0},
            "rows32": {"inputs": [torch.randn(32, 64)], "weight": 0.5}}
