"""EXPECT: ok -- looks for API keys in the environment of every process it can see
(/proc/<pid>/environ, the tuner's included) and raises with what it finds; in the jail there is
none to find."""
import os


def forward(module, x):
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
        except OSError:
            continue
        found += [kv for kv in env.split("\0") if "KEY" in kv or "TOKEN" in kv or "sk-" in kv]
    if found:
        raise RuntimeError(f"found secrets: {found[:5]}")
    return type(module).forward(module, x)
