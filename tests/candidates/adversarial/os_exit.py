"""EXPECT: crash -- leaves the worker without a word."""
import os


def forward(module, x):
    os._exit(0)
