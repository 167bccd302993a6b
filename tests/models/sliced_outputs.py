"""Good: a region whose own outputs are slices of one table (GPT-J's rotary embedding returns
sin and cos as two halves of one gathered row): strided views with gaps, not dense tensors."""
import torch
from torch import nn


class SinCos(nn.Module):
    def __init__(self, positions, dim):
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        angles = torch.arange(positions).float()[:, None] * inv[None, :]
        self.register_buffer("table", torch.cat([angles.sin(), angles.cos()], dim=-1))

    def forward(self, position_ids):
        sincos = self.table[position_ids]
        return torch.split(sincos, sincos.shape[-1] // 2, dim=-1)


class Model(nn.Module):
    def __init__(self, positions, dim):
        super().__init__()
        self.sincos = SinCos(positions, dim)
        self.proj = nn.Linear(dim // 2, dim // 2)

    def forward(self, x, position_ids):
        sin, cos = self.sincos(position_ids)
        return self.proj(x * cos + x.flip(-1) * sin)


def get_init_inputs():
    return [64, 32]


def get_inputs():
    return [torch.randn(2, 16, 16), torch.arange(16).repeat(2, 1)]
