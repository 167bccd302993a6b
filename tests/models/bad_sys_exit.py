"""Bad: the file exits the interpreter when it is imported (as a script written for `python` might)."""
import sys

import torch
from torch import nn

sys.exit(3)


class Model(nn.Module):
    def forward(self, x):
        return x


def get_init_inputs():
    return []


def get_inputs():
    return [torch.randn(3)]
