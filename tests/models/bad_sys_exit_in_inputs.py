"""Bad: get_inputs() calls sys.exit."""
import sys

import torch
from torch import nn


class Model(nn.Module):
    def forward(self, x):
        return x * 2


def get_init_inputs():
    return []


def get_inputs():
    sys.exit("no inputs here")
