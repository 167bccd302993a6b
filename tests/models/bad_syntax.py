"""Bad: does not parse (missing colon on line 6)."""
import torch
from torch import nn


class Model(nn.Module)
    def forward(self, x):
        return x
