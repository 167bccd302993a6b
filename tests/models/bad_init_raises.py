"""Bad: Model.__init__ raises."""
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        raise ValueError(f"dim {dim} is not supported")


def get_init_inputs():
    return [3]


def get_inputs():
    return [torch.randn(3)]
