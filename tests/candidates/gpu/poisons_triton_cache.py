"""EXPECT: ok -- plants files in every Triton cache directory it can reach (its own HOME's, the
tuner's if it could find it, /root's), hoping a later trial or the baseline loads a poisoned
kernel; each worker has a cache of its own in its jail, so the next trial compiles afresh."""
import os


def forward(module, x):
    for d in (os.path.expanduser("~/.triton/cache"), os.environ.get("TRITON_CACHE_DIR", ""),
              "/root/.triton/cache", "{run_dir}/.triton-cache"):
        if not d:
            continue
        try:
            os.makedirs(os.path.join(d, "poison"), exist_ok=True)
            with open(os.path.join(d, "poison", "kernel.json"), "w") as f:
                f.write('{"poisoned": true}')
        except OSError:
            pass
    return type(module).forward(module, x)
