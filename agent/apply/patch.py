"""The model patch: one marked block appended to the user's model file that loads the kernels
module by path from next to the model file and calls `install(globals())`. `git apply` it
from the model file's directory (paths a/<file>, b/<file>)."""

from __future__ import annotations

import ast
import difflib
import hashlib
from pathlib import Path

from agent.apply.merge import is_main_guard
from agent.errors import UserError

BLOCK_MARK = "# nightshift: route tuned regions through"
BLOCK_END = "_nightshift_install(globals())"


def routing_block(kernels_file: str, run_id: str, derived: list[str] = ()) -> list[str]:
    """The block's lines; `derived`: regions whose kernels keep weights derived from the module's
    parameters (a concatenated [q; k; v] or [gate; up]), which the block then says in a line."""
    keeps = [f"# {', '.join(derived)}: weights derived from the parameters (a concatenated [q; k; v] or [gate; up]) "
             "are built on first use and kept as plain attributes, rebuilt when a parameter changes, never "
             "registered: state_dict() keys stay the original ones and an original checkpoint loads "
             "(load_state_dict(strict=True))."] \
        if derived else []
    return [
        f"{BLOCK_MARK} {kernels_file} (run {run_id})",
        *keeps,
        "# Loaded by file path from next to this file rather than by `import`: that works however",
        "# this file is imported (by path under another module name, as KernelBench harnesses and",
        "# nightshift do, from a package, or run as a script), whatever characters its name holds,",
        "# and never picks up a same-named module elsewhere on sys.path. NIGHTSHIFT_DISABLE=1 keeps",
        "# the original forwards; so does a machine where the kernels' imports (Triton) are missing.",
        "def _nightshift_install(namespace):",
        "    import hashlib, importlib.util, os, sys, warnings",
        f"    path = os.path.join(os.path.dirname(os.path.realpath(__file__)), {kernels_file!r})",
        "    name = 'nightshift_kernels_' + hashlib.sha256(path.encode()).hexdigest()[:16]",
        "    module = sys.modules.get(name)",
        "    if module is None:",
        "        spec = importlib.util.spec_from_file_location(name, path)",
        "        module = importlib.util.module_from_spec(spec)",
        "        sys.modules[name] = module  # registered before it runs, as `import` does",
        "        try:",
        "            spec.loader.exec_module(module)",
        "        except ImportError as e:",
        "            del sys.modules[name]",
        "            warnings.warn(f'nightshift: {path} cannot be imported here ({e}); the original forwards run',",
        "                          stacklevel=2)",
        "            return []",
        "        except BaseException:",
        "            del sys.modules[name]",
        "            raise",
        "    return module.install(namespace)",
        "",
        "",
        BLOCK_END,
    ]


def find_block(lines: list[str]) -> tuple[int, int] | None:
    """(first, last) line index of the nightshift block in the model file, if it has one."""
    start = next((i for i, ln in enumerate(lines) if ln.startswith(BLOCK_MARK)), None)
    if start is None:
        return None
    end = next((j for j in range(start, len(lines)) if lines[j].rstrip("\r\n") == BLOCK_END), None)
    if end is None:
        raise UserError(f"the model file has a nightshift block at line {start + 1} without its closing "
                        f"`{BLOCK_END}` line; remove the block and run agent apply again")
    return start, end


def patched_lines(text: str, kernels_file: str, run_id: str, path: Path,
                  derived: list[str] = ()) -> tuple[list[str], list[str]]:
    """(old lines, new lines) of the model file, with ends kept."""
    nl = "\r\n" if "\r\n" in text else "\n"
    old = text.splitlines(keepends=True)
    block = [ln + nl for ln in routing_block(kernels_file, run_id, derived)]
    found = find_block(old)
    if found is not None:  # already has a block: bring it up to date (usually: unchanged)
        start, end = found
        last = old[end]
        block[-1] = block[-1] if last.endswith(("\n", "\r")) else block[-1].rstrip("\r\n")
        return old, old[:start] + block + old[end + 1:]
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        raise UserError(f"{path}: syntax error at line {e.lineno}: {e.msg}") from None
    # Before a trailing `if __name__ == "__main__":`, so running the file as a script is routed too.
    at = len(old)
    if tree.body and is_main_guard(tree.body[-1]):
        at = tree.body[-1].lineno - 1
        while at > 0 and old[at - 1].strip().startswith("#"):
            at -= 1  # keep the comments that introduce the guard with it
    before, after = list(old[:at]), old[at:]
    if before and not before[-1].endswith(("\n", "\r")):
        before[-1] += nl
    blank = 0
    while blank < len(before) and not before[-1 - blank].strip():
        blank += 1
    sep = [nl] * max(0, 2 - blank) if before else []
    tail = [nl, nl] if after else []
    return old, before + sep + block + tail + after


def unified_patch(old: list[str], new: list[str], name: str) -> str:
    """`git apply`-able from the model file's directory (paths a/<file>, b/<file>)."""
    if old == new:
        return ""
    out = []
    for line in difflib.unified_diff(old, new, f"a/{name}", f"b/{name}"):
        if line[:1] in " +-" and not line.startswith(("--- ", "+++ ")) and not line.endswith("\n"):
            line += "\n\\ No newline at end of file\n"
        out.append(line)
    return "".join(out)


def model_unchanged(lines: list[str], want_hash: str) -> bool:
    """The model file is the one the run froze, apart from a nightshift block added since."""
    def digest(ls):
        return hashlib.sha256("".join(ls).encode()).hexdigest()
    if not want_hash or digest(lines) == want_hash:
        return True
    found = find_block(lines)
    if found is None:
        return False
    start, end = found
    for pre in range(3):
        for post in range(3):
            if digest(lines[:max(0, start - pre)] + lines[end + 1 + post:]) == want_hash:
                return True
    return False
