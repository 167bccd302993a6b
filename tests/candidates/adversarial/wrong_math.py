"""EXPECT: wrong -- RMSNorm without the weight."""
import torch


def forward(module, x):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.eps)).to(x.dtype)
