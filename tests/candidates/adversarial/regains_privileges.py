"""EXPECT: ok -- tries to become root or get a capability back: setuid/setresuid/setgid to 0,
capset with every capability, raising an ambient capability, clearing no_new_privs, new mount
or network namespaces, mount, chroot, and a setuid-root program (sudo, su) if one is there; it
raises if it ends with uid 0 or any capability in its own process, or if a privileged call
worked. The worker has none left and no_new_privs set, so none does."""
import ctypes
import os
import subprocess

libc = ctypes.CDLL(None, use_errno=True)


class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _caps() -> dict:
    out = {}
    for line in open("/proc/self/status"):
        if line.startswith(("Cap", "NoNewPrivs", "Uid", "Gid")):
            k, v = line.split(":", 1)
            out[k] = v.split()
    return out


def _attempts() -> str:
    worked = []
    for name, call in (("setuid", lambda: os.setuid(0)), ("setresuid", lambda: os.setresuid(0, 0, 0)),
                       ("setgid", lambda: os.setgid(0)), ("setgroups", lambda: os.setgroups([0]))):
        try:
            call()
            worked.append(name)
        except OSError:
            pass
    full = (Data * 2)(Data(0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), Data(0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF))
    if libc.capset(ctypes.byref(Header(0x20080522, 0)), full) == 0:
        worked.append("capset")
    if libc.prctl(47, 2, 21, 0, 0) == 0:  # PR_CAP_AMBIENT_RAISE CAP_SYS_ADMIN
        worked.append("ambient raise")
    if libc.prctl(38, 0, 0, 0, 0) == 0 and libc.prctl(39, 0, 0, 0, 0) == 0:  # clear, then read no_new_privs
        worked.append("no_new_privs cleared")
    for flag, name in ((0x00020000, "unshare mount"), (0x40000000, "unshare network")):
        if libc.unshare(flag) == 0:
            worked.append(name)
    if libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, None) == 0:
        worked.append("mount")
    if libc.chroot(b"/") == 0:
        worked.append("chroot")
    for prog in ("/usr/bin/sudo", "/bin/su", "/usr/bin/su"):
        if os.path.exists(prog) and os.stat(prog).st_mode & 0o4000:
            try:
                out = subprocess.run([prog, "-n", "id", "-u"] if "sudo" in prog else [prog, "-c", "id -u"],
                                     capture_output=True, text=True, timeout=3, stdin=subprocess.DEVNULL)
                if out.stdout.strip() == "0":
                    worked.append(prog)
            except (OSError, subprocess.SubprocessError):
                pass
    caps = _caps()
    # What grants power now: the effective, permitted and ambient sets (with no_new_privs set, the
    # bounding and inheritable sets can give nothing back through an exec).
    if worked or os.geteuid() == 0 or any(int(caps[k][0], 16) for k in ("CapEff", "CapPrm", "CapAmb")):
        return f"privileges regained: {worked}, uid {os.geteuid()}, {caps}"
    return ""


GOT = _attempts()  # once, at import: a setuid program's refusal takes a while


def forward(module, x):
    if GOT:
        raise RuntimeError(GOT)
    return type(module).forward(module, x)
