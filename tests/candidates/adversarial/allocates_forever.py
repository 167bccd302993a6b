"""EXPECT: oom -- allocates until the worker's memory cap stops it (address space on the CPU,
the memory fraction on a GPU)."""
import torch


def forward(module, x):
    hoard = []
    while True:
        hoard.append(torch.empty(1 << 28, device=x.device))
