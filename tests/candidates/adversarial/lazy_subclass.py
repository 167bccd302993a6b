"""EXPECT: shape -- returns a tensor subclass that could compute its values only when read."""
import torch


class Lazy(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def forward(module, x):
    return type(module).forward(module, x).as_subclass(Lazy)
