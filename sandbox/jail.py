"""The jail around a sandbox worker: bubblewrap where the machine has it, what Linux allows otherwise.

With bubblewrap (Debian's `bubblewrap`, `bwrap`), a worker runs in its own mount, pid, network,
IPC and UTS namespaces:

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

Without bubblewrap, the worker still gets a scrubbed environment, a private temporary folder,
its own session and (where the kernel allows) an empty network namespace, and `describe()`
says plainly what is then NOT isolated; `agent doctor` and the report print it.
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


def bwrap_path() -> str | None:
    """`NIGHTSHIFT_BWRAP` names a bwrap binary (one unpacked from Debian's package, say);
    `NIGHTSHIFT_NO_BWRAP=1` turns the jail off (to test the fallback)."""
    if os.environ.get("NIGHTSHIFT_NO_BWRAP") == "1":
        return None
    return os.environ.get("NIGHTSHIFT_BWRAP") or shutil.which("bwrap")


@functools.cache
def bwrap_works() -> str:
    """'' if bubblewrap can start a jail here, else why not (checked once per process)."""
    exe = bwrap_path()
    if exe is None:
        return "bubblewrap (bwrap) is not installed: apt-get install bubblewrap"
    argv = jail_argv(["/bin/true"], weak=[], strong=[], visible=[], gpu=False)
    try:
        done = subprocess.run(argv, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bubblewrap failed to start: {e}"
    if done.returncode != 0:
        return f"bubblewrap cannot make namespaces here: {done.stderr.decode(errors='replace').strip()[:200]}"
    return ""


def describe() -> Isolation:
    """What a worker started now is isolated from, and what not."""
    why = bwrap_works() if bwrap_path() else "bubblewrap is turned off (NIGHTSHIFT_NO_BWRAP=1) or not installed"
    if not why:
        who = "runs as the unprivileged user nobody" if os.geteuid() == 0 else \
            "runs as this (unprivileged) user in a user namespace"
        return Isolation("bubblewrap", [
            "filesystem: host root read-only; HOME, /root, /home, /tmp, /run, run folders and .git hidden",
            "processes: own pid namespace (cannot signal the tuner; its children die with it)",
            "network: empty network namespace", f"user: {who}, no capabilities",
            "environment: rebuilt from an allow-list (no keys or tokens)"],
            ["the GPU: sibling workers share the device (timings are taken under a device lock)",
             "world-readable files outside the hidden folders can be read"])
    return Isolation("none", ["environment: rebuilt from an allow-list (no keys or tokens)",
                              "network: an empty network namespace where the kernel allows one"],
                     ["filesystem: the worker runs as the tuner's user and can read and write what it can, "
                      "run folders included", "processes: a candidate can signal the tuner and start processes "
                      "that outlive its trial", "user: same user as the tuner"], why)


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


def _bind_back(argv: list[str], path: str, hidden: list[str], made: set[str]) -> None:
    """Mount `path` back read-only inside a hidden folder, with world-traversable parents."""
    chain, parent = [], os.path.dirname(path)
    while parent not in ("/", "") and parent not in hidden:
        chain.append(parent)
        parent = os.path.dirname(parent)
    for d in reversed(chain):
        if d not in made:
            argv += ["--perms", "0755", "--dir", d]
            made.add(d)
    argv += ["--ro-bind", path, path]


def jail_argv(cmd: list[str], *, weak: list[str], strong: list[str], visible: list[str], gpu: bool,
              keep: list[str] = ()) -> list[str]:
    """The bwrap command line that runs `cmd` in the jail described in the module docstring.
    `keep`: folders (the model's) visible even inside a strongly hidden one."""
    visible = sorted({os.path.realpath(v) for v in visible if os.path.exists(v)})
    weak = [w for w in weak if w not in visible] + ([] if "/tmp" in weak else ["/tmp"])  # the workdir's tmpfs
    argv = [bwrap_path() or "bwrap", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
    for h in sorted(weak, key=lambda s: s.count("/")):
        argv += ["--perms", "0755", "--tmpfs", h]
    made: set[str] = set()
    for v in visible:
        if any(_under(v, h) for h in weak):
            _bind_back(argv, v, weak, made)
    for h in sorted(strong, key=lambda s: s.count("/")):  # after the binds: hidden inside them too
        argv += ["--perms", "0755", "--tmpfs", h]
    for k in sorted({os.path.realpath(k) for k in keep if os.path.exists(k)}):
        inside = [h for h in strong if _under(k, h) and h != k]
        if inside:  # the strong tmpfs above replaced any parents made before: make them again
            _bind_back(argv, k, inside, set())
    argv += ["--perms", "1777", "--dir", WORKDIR]  # writable by the unprivileged user the worker becomes
    if gpu:
        for dev in sorted(glob.glob("/dev/nvidia*") + glob.glob("/dev/dri") + glob.glob("/dev/kfd")):
            argv += ["--dev-bind", dev, dev]
    argv += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
             "--die-with-parent", "--new-session", "--chdir", WORKDIR]
    if os.geteuid() == 0:
        # Root outside: no user namespace; the worker keeps only the right to drop to `nobody`.
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user"]
    return argv + ["--"] + cmd


def wrap(cmd: list[str], *, hide: list[Path], model_files: list[Path], gpu: bool) -> tuple[list[str], Isolation, str]:
    """(argv, isolation, cwd inside) for a worker command: jailed with bubblewrap when it works.
    `hide`: run folders (and any other folder) the worker must never see."""
    iso = describe()
    if iso.kind != "bubblewrap":
        return cmd, iso, ""
    model_dirs = [str(Path(m).resolve().parent) for m in model_files]
    weak, strong = hidden_paths([Path(h) for h in hide] + [Path(d) for d in model_dirs])
    strong = [s for s in strong if s not in model_dirs]
    return (jail_argv(cmd, weak=weak, strong=strong, visible=python_paths() + model_dirs, gpu=gpu, keep=model_dirs),
            iso, WORKDIR)
