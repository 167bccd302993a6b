"""EXPECT: crash -- dereferences a null pointer."""
import ctypes


def forward(module, x):
    ctypes.string_at(0)
