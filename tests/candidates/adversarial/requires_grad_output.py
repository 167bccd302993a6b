"""EXPECT: shape -- returns an output that requires grad (the region's do not)."""
import torch


def forward(module, x):
    with torch.enable_grad():
        w = module.weight.detach().requires_grad_(True)
        h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + module.eps)
        return w * h.to(x.dtype)
