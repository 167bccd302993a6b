"""EXPECT: ok -- writes a poisoned file (a Python module and a Triton cache entry named like the
real ones) into every place a sibling worker might read: its folder's parent, /tmp, /dev/shm,
/var/tmp, /run, /dev, HOME's and the kernel caches' folders (Triton's, Inductor's), a System V
shared memory segment, a POSIX message queue, an abstract unix socket and its user's keyring;
then behaves. Whatever it manages stays
in its own worker: a sibling forked from the same fork server sees none of it
(tests/test_forkserver.py runs a second worker that looks)."""
import os
import platform
import socket

POISON = b"import os\nos.environ['POISONED'] = '{marker}'\n"
PLACES = ["..", "/tmp", "/dev/shm", "/var/tmp", "/run", "/dev", os.path.expanduser("~"),
          os.path.expanduser("~/.triton/cache"), os.environ.get("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_nobody"),
          os.environ.get("TRITON_CACHE_DIR", "/tmp/triton")]
_held = []


def _poison() -> None:
    for place in PLACES:
        try:
            os.makedirs(place, exist_ok=True)
            for name in ("poison_{marker}.py", "sitecustomize.py", "__triton_launcher.so"):
                with open(os.path.join(place, name), "wb") as f:
                    f.write(POISON)
        except OSError:
            pass
    import ctypes
    libc = ctypes.CDLL(None)
    libc.shmget(0x5EED, 4096, 0o1666)  # IPC_CREAT | 0666: a System V segment under a fixed key
    try:  # a POSIX message queue (O_CREAT | O_RDWR)
        ctypes.CDLL("librt.so.1").mq_open(b"/poison_{marker}", 0o102, 0o666, None)
    except OSError:
        pass
    add_key = {"x86_64": 248, "aarch64": 217}.get(platform.machine())
    if add_key:  # a key in its user's keyring (KEY_SPEC_USER_KEYRING)
        libc.syscall(add_key, b"user", b"poison_{marker}", b"POISON", 6, ctypes.c_long(-4))
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind("\0poison_{marker}")
        s.listen(1)
        _held.append(s)
    except OSError:
        pass


_poison()


def forward(module, x):
    return type(module).forward(module, x)
