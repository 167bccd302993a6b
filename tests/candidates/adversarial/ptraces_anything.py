"""EXPECT: ok -- tries to read another process's memory every way Linux has: opening
/proc/<pid>/mem, PTRACE_ATTACH and PTRACE_SEIZE, process_vm_readv and pidfd_getfd, on every
pid it can name up to 4,096 but its own threads; it raises if any worked. A forked worker can name only
its own namespace's init, which is root's or holds capabilities and is non-dumpable."""
import ctypes
import os

libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
libc.syscall.restype = ctypes.c_long
PTRACE_ATTACH, PTRACE_DETACH, PTRACE_SEIZE = 16, 17, 0x4206
SYS_PIDFD_OPEN, SYS_PIDFD_GETFD = 434, 438


class IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _tries(pid: int) -> list[str]:
    worked = []
    try:
        with open(f"/proc/{pid}/mem", "rb") as f:
            f.read(1)
        worked.append("mem")
    except OSError:
        pass
    for req in (PTRACE_ATTACH, PTRACE_SEIZE):
        if libc.ptrace(req, pid, None, None) == 0:
            worked.append(f"ptrace {req}")
            libc.ptrace(PTRACE_DETACH, pid, None, None)
    buf = ctypes.create_string_buffer(8)
    local, remote = IOVec(ctypes.cast(buf, ctypes.c_void_p), 8), IOVec(0x400000, 8)
    if libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) > 0:
        worked.append("process_vm_readv")
    fd = libc.syscall(SYS_PIDFD_OPEN, pid, 0)
    if fd >= 0:
        got = libc.syscall(SYS_PIDFD_GETFD, fd, 0, 0)
        if got >= 0:
            worked.append("pidfd_getfd")
            os.close(got)
        os.close(fd)
    return worked


def forward(module, x):
    own = {int(t) for t in os.listdir("/proc/self/task")}  # its own threads: its own memory
    worked = {pid: w for pid in range(1, 4097) if pid not in own and (w := _tries(pid))}
    if worked:
        raise RuntimeError(f"reached other processes: {worked}")
    return type(module).forward(module, x)
