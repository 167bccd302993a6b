"""Bad: the inputs do not fit the layer, so forward raises (a user's usual mistake)."""
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(x)


def get_init_inputs():
    return []


def get_inputs():
    return [torch.randn(2, 7)]
