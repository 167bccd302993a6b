"""What the worker does to itself before any candidate runs, and the environment it gets.

Each measure that the OS refuses is reported, not fatal: the worker's hello message says
which protections are in force, and `agent try --json` shows it.
"""

from __future__ import annotations

import ctypes
import os
import re
import resource
import signal
import sys

PR_SET_PDEATHSIG = 1
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000

# Only these reach a worker; everything else (API keys, cloud credentials, tokens) stays out.
# Inductor's settings (TORCHINDUCTOR_*) are the user's: a compile mode is measured as they get it
# (its cache folder is the harness's own, and its compile threads where the harness sets them).
ENV_ALLOW = re.compile(
    r"^(PATH|LANG|LC_[A-Z]+|TZ|PYTHONPATH|PYTHONHASHSEED|LD_LIBRARY_PATH|CUDA_HOME|CUDA_PATH|"
    r"ROCM_PATH|HIP_PATH|TRITON_[A-Z_]+|NCCL_[A-Z_]+|TORCH_[A-Z_]+|TORCHINDUCTOR_[A-Z_]+|NVSHMEM_[A-Z_]+|"
    r"OMP_NUM_THREADS|MKL_NUM_THREADS|OPENBLAS_[A-Z_]+|NVIDIA_[A-Z_]+|NIGHTSHIFT_WORKER)$")
SECRET_HINT = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH", re.IGNORECASE)


# What the worker's own environment says about where it is and what it may use: a model file
# that read these at freeze time read the tuner's values (its home, its /tmp, its caches), which
# inside the jail are hidden or not writable.
HARNESS_OWNED = re.compile(
    r"^(HOME|TMPDIR|TMP|TEMP|USER|LOGNAME|PWD|OLDPWD|SHELL|PATH|LD_LIBRARY_PATH|LD_PRELOAD|PYTHON[A-Z_]*|"
    r"CUDA_VISIBLE_DEVICES|HIP_VISIBLE_DEVICES|ROCR_VISIBLE_DEVICES|NIGHTSHIFT_[A-Z_]+|XDG_[A-Z_]+|"
    r"TORCHINDUCTOR_CACHE_DIR|TRITON_CACHE_DIR|TRITON_HOME|TORCH_HOME|HF_HOME|HF_[A-Z_]*CACHE[A-Z_]*)$")


def model_settings(env: dict[str, str]) -> dict[str, str]:
    """The variables a model file read at freeze time, as the worker applies them: its settings
    (LLAMA_PRESET), never a name the harness owns."""
    return {k: str(v) for k, v in env.items() if isinstance(k, str) and not HARNESS_OWNED.match(k)}


def worker_env(base: dict[str, str], workdir: str, visible_device: str | None) -> dict[str, str]:
    env = {k: v for k, v in base.items() if ENV_ALLOW.match(k) and not SECRET_HINT.search(k)}
    env.update(HOME=workdir, TMPDIR=workdir, PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1",
               # The worker's own: inductor otherwise derives one from the user name, a folder that
               # another user (or the worker as `nobody`) may not be able to write.
               TORCHINDUCTOR_CACHE_DIR=os.path.join(workdir, "torchinductor"))
    if visible_device is None:
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        env["CUDA_VISIBLE_DEVICES"] = visible_device
        env["HIP_VISIBLE_DEVICES"] = visible_device
    return env


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def die_with_parent(parent_pid: int) -> str:
    if not sys.platform.startswith("linux"):
        return "not available on this OS"
    if _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return f"prctl failed (errno {ctypes.get_errno()})"
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)
    return "on"


def drop_privileges(uid: int = 65534, gid: int = 65534) -> str:
    """Inside the jail, before any candidate code: a root worker becomes `nobody` with no
    capabilities left (setuid from root clears them); any other user stays who it is."""
    if os.geteuid() != 0:
        return f"unprivileged user (uid {os.geteuid()})"
    try:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    except OSError as e:
        return f"still root: could not drop privileges ({e})"
    if os.geteuid() == 0 or os.getuid() == 0:
        return "still root: setuid did not take"
    return f"unprivileged user nobody (uid {uid}), no capabilities"


def limit_resources(memory_bytes: int | None, max_file_bytes: int = 4 << 30) -> dict[str, str]:
    done = {}
    for name, rlim, value in (("core", resource.RLIMIT_CORE, 0),
                              ("file_size", resource.RLIMIT_FSIZE, max_file_bytes),
                              ("address_space", resource.RLIMIT_AS, memory_bytes)):
        if value is None:
            done[name] = "unlimited"
            continue
        try:
            resource.setrlimit(rlim, (value, value))
            done[name] = str(value)
        except (ValueError, OSError) as e:
            done[name] = f"not set ({e})"
    return done


def drop_network() -> str:
    """Move into an empty network namespace: no interface but a down loopback."""
    if not sys.platform.startswith("linux"):
        return "not isolated (not Linux)"
    libc = _libc()
    if libc.unshare(CLONE_NEWNET) == 0:
        return "isolated (new network namespace)"
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        try:
            for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                               ("/proc/self/gid_map", f"{gid} {gid} 1")):
                with open(path, "w") as f:
                    f.write(text)
        except OSError:
            pass
        return "isolated (user + network namespace)"
    return f"not isolated (unshare refused: errno {ctypes.get_errno()})"
