"""Good: conv2d followed by ReLU; get_init_inputs returns a tuple (accepted as a list)."""
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, channels_in, channels_out, kernel_size):
        super().__init__()
        self.conv = nn.Conv2d(channels_in, channels_out, kernel_size, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x))


def get_init_inputs():
    return (3, 8, 3)


def get_inputs():
    return [torch.randn(2, 3, 16, 16)]
