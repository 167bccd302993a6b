"""EXPECT: ok -- reads dotfiles, the checkout's .git/config and a secret planted in the run
folder, and raises with what it reads; in the jail none of them is visible."""
import os

PATHS = ["{secret_path}", "{git_config}", os.path.expanduser("~root/.bashrc"), "/root/.netrc"]


def forward(module, x):
    found = []
    for p in PATHS:
        try:
            found.append(open(p).read()[:200])
        except OSError:
            pass
    if found:
        raise RuntimeError(f"read: {found}")
    return type(module).forward(module, x)
