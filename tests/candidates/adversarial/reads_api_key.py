"""EXPECT: runtime_error -- the key is not in a worker's environment, so this raises KeyError."""
import os


def forward(module, x):
    key = os.environ["ANTHROPIC_API_KEY"]
    raise RuntimeError(f"leaked {key}")
