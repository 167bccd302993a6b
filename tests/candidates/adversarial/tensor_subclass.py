"""EXPECT: shape -- returns a tensor subclass that could lie about its contents."""
import torch


class Sneaky(torch.Tensor):
    pass


def forward(module, x):
    return type(module).forward(module, x).as_subclass(Sneaky)
