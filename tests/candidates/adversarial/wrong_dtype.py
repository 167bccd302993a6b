"""EXPECT: shape"""
import torch


def forward(module, x):
    return type(module).forward(module, x).to(torch.float64)
