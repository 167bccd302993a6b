"""EXPECT: oom -- allocates until the worker's memory cap stops it."""
import torch


def forward(module, x):
    hoard = []
    while True:
        hoard.append(torch.ones(1 << 27, device=x.device))
