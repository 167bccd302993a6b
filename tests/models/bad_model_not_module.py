"""Bad: Model is a plain class, not a torch.nn.Module."""
import torch


class Model:
    def __call__(self, x):
        return x + 1


def get_init_inputs():
    return []


def get_inputs():
    return [torch.randn(4)]
