"""What a forked worker does to itself, step by step, so that it is isolated as a worker that
bubblewrap started is (sandbox/jail.py): the Linux calls, through libc, that the fork server
(sandbox/forkserver.py) runs in each child it forks.

Three processes per worker, as bubblewrap makes them: the *setup* process (forked by the fork
server) leaves the server's session and takes new mount, pid, IPC, network and UTS namespaces,
mounts a fresh sized tmpfs on the worker's folder and on /dev/shm and a new pty instance, and
makes every other writable folder of the jail read-only; the *init* process (pid 1 of the new pid
namespace) mounts a /proc of that namespace; the *worker* (pid 2) drops every capability, becomes
`nobody` when the tuner is root, sets no_new_privs and turns non-dumpable before any candidate
code runs. Each step that fails raises `SetupError`: the fork server says why, never a weaker
worker.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import socket
import struct

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_GET_DUMPABLE = 1, 4, 3
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_GET_NO_NEW_PRIVS = 24, 38, 39
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
NOBODY = 65534
WORKER_NAMESPACES = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWUTS
PROC_COVERS = ("sys", "sysrq-trigger", "irq", "bus")
"""What bubblewrap mounts read-only over a /proc it makes (the kernel's knobs and old device trees)."""
KEPT_WRITABLE = ("/proc", "/dev/pts", "/dev/shm")
"""Mounts the setup leaves as they are: replaced by the worker's own (/proc by its init)."""
_FLAG_NAMES = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
               "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}


class SetupError(Exception):
    """A step of a worker's isolation failed: the worker must not run."""


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(errno)} (errno {errno})")


def _bytes(s: str | None) -> bytes | None:
    return None if s is None else s.encode()


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(_bytes(source), _bytes(target), _bytes(fstype), flags, _bytes(data)),
           f"mount {fstype or source or ''} on {target}")


def prctl(option: int, arg: int = 0) -> int:
    return _libc.prctl(option, arg, 0, 0, 0)


def _unescape(field: str) -> str:
    """A mountinfo path: spaces, tabs, newlines and backslashes come octal-escaped."""
    return field.encode().decode("unicode_escape") if "\\" in field else field


def mounts() -> list[tuple[str, set[str]]]:
    """(mount point, its per-mount options) of every mount this process sees."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6:
                out.append((_unescape(fields[4]), set(fields[5].split(","))))
    return out


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def freeze_shared_mounts(keep: list[str]) -> list[str]:
    """Every writable folder mount of the jail becomes read-only in this mount namespace, but for
    `keep` (a compile cache bound writable on purpose) and the ones the worker gets its own of:
    a sibling forked from the same server would otherwise see what this one wrote there (the
    jail's tmpfs mounts belong to the tuner's user where it is not root). The mount points made
    read-only."""
    done = []
    for point, options in mounts():
        if "rw" not in options or any(_under(point, k) for k in KEPT_WRITABLE) or point in keep:
            continue
        if not os.path.isdir(point) or os.path.islink(point):
            continue  # a device node bound in (/dev/null, a GPU): no storage
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for name, bit in _FLAG_NAMES.items():
            if name in options:
                flags |= bit
        mount(None, point, None, flags)
        done.append(point)
    return done


def _loopback_up() -> None:
    """The new network namespace's loopback, up as bubblewrap leaves it (nothing else is there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH", b"lo", 0)))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 1))  # SIOCSIFFLAGS, IFF_UP


def enter_worker_namespaces(workdir: str, folder_bytes: int, keep_writable: list[str]) -> None:
    """The setup process's part: new namespaces (the pid one applies to its next child), and a
    mount namespace in which the worker's folder and /dev/shm are fresh tmpfs mounts of its own,
    /dev/pts a new instance, and nothing else the jail holds is writable."""
    os.setsid()  # out of the fork server's session and process group
    _check(_libc.unshare(WORKER_NAMESPACES), "unshare (mount, pid, IPC, network, UTS namespaces)")
    mount("none", "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the fork server
    freeze_shared_mounts(keep_writable)
    mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, f"size={folder_bytes},mode=1777")
    mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={folder_bytes},mode=1777")
    mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620")
    try:
        _loopback_up()
    except OSError as e:
        raise SetupError(f"loopback of the new network namespace: {e}") from None


def mount_own_proc() -> None:
    """The init process's part (pid 1 of the worker's pid namespace): a /proc showing only that
    namespace, the kernel's knobs in it read-only as bubblewrap leaves them."""
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name in PROC_COVERS:
        path = f"/proc/{name}"
        if os.path.exists(path):
            mount(path, path, None, MS_BIND | MS_REC)
            mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 40


def _drop_bounding_set() -> None:
    for cap in range(_last_cap() + 1):
        if prctl(PR_CAPBSET_DROP, cap) != 0 and ctypes.get_errno() != 22:  # EINVAL: no such cap here
            raise SetupError(f"dropping capability {cap} from the bounding set: errno {ctypes.get_errno()}")


def _own_user_namespace() -> str:
    """A user namespace mapping only this user onto itself: what it buys is a keyring of its own
    (the kernel keeps a user's keyring per user namespace; `nobody`'s is otherwise one for every
    worker, a place a sibling could read). Where the kernel refuses unprivileged user namespaces,
    that keyring stays shared, as it is for a worker started afresh, and the hello says so."""
    uid, gid = os.getuid(), os.getgid()
    prctl(PR_SET_DUMPABLE, 1)  # its own /proc/self/*_map are root's while it is not dumpable
    if _libc.unshare(CLONE_NEWUSER) != 0:
        return f"keyring: shared with other processes of uid {uid} (no user namespace: errno {ctypes.get_errno()})"
    for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                       ("/proc/self/gid_map", f"{gid} {gid} 1")):
        with open(path, "w") as f:
            f.write(text)
    _drop_bounding_set()  # a new user namespace gives every capability again, within it: gone below
    return "keyring: its own (a user namespace mapping only its user)"


def drop_to_worker(uid: int = NOBODY, gid: int = NOBODY, own_keyring: bool = True) -> str:
    """The worker's part, before any candidate code: no capability left in any set (bounding and
    ambient included), `nobody` when it is root, no_new_privs, non-dumpable (no sibling's ptrace or
    /proc/<pid>/mem, should one ever name it), and a keyring of its own where the kernel allows
    (`_own_user_namespace`). What it became, as the worker's hello reports it."""
    _drop_bounding_set()
    _check(prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL), "clearing ambient capabilities")
    root = os.geteuid() == 0
    if root:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    keyring = _own_user_namespace() if own_keyring else "keyring: shared with other processes of its user"
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(_CapHeader(0x20080522, 0)), data), "capset")
    _check(prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL), "clearing ambient capabilities")
    _check(prctl(PR_SET_NO_NEW_PRIVS, 1), "no_new_privs")
    _check(prctl(PR_SET_DUMPABLE, 0), "non-dumpable")
    caps = capabilities()
    if any(caps.values()) or (root and 0 in (os.getuid(), os.geteuid(), os.getgid(), os.getegid())):
        raise SetupError(f"privileges left after the drop: uid {os.getuid()}, capabilities {caps}")
    who = f"unprivileged user nobody (uid {uid})" if root else f"unprivileged user (uid {os.geteuid()})"
    return f"{who}, no capabilities, no_new_privs, non-dumpable; {keyring}"


def capabilities() -> dict[str, int]:
    """This process's capability sets, as /proc/self/status states them."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Cap") and ":" in line:
                name, value = line.split(":", 1)
                out[name] = int(value.strip(), 16)
    return out


def die_with_parent() -> None:
    _check(prctl(PR_SET_PDEATHSIG, signal.SIGKILL), "parent-death signal")
