"""EXPECT: aliased -- writes each answer into one buffer it keeps per shape and returns that
buffer: right values, but the caller's earlier output changes under its feet."""
import torch

_buffers = {}


def forward(module, x):
    out = _buffers.get(x.shape)
    if out is None:
        out = _buffers[x.shape] = torch.empty_like(x)
    out.copy_(type(module).forward(module, x))
    return out
