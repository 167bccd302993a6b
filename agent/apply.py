"""`agent apply RUN`: the winners as files the user commits next to their model.

Two things come out of a run:

- `<model_dir>/<model_stem>_nightshift.py`, ONE module holding every winning candidate, merged
  with `ast` (agent/merge.py): every name a candidate binds at module level is renamed to a
  region-specific one (`forward` -> `forward_LlamaRMSNorm`), scope-aware (agent/rename.py), and
  imports are hoisted and deduplicated. The module ends with `REGIONS`, `CLASSES` and
  `install(namespace)`, which points each region class's `forward` at its tuned forward.
- `<run>/patches/<model_stem>.patch`, a unified diff that appends one marked block to the
  model file: it loads the kernels module by path from next to the model file and calls
  `install(globals())`. `git apply` it from the model file's directory.

Winners: the regions integration kept end to end (`integration.json`'s `accepted`) when that
file exists, otherwise the best kept candidate per region in the run's store. Applying twice
is harmless: a model file that already carries the block gets an empty patch, and the
kernels module is rewritten byte for byte the same.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from agent.jobs import UserError
from agent.merge import CandidateSkipped, is_main_guard, kernels_module_text
from tools.e2e import IntegrationResult
from tools.problem import Problem
from tools.runfolder import RunFolder

BLOCK_MARK = "# nightshift: route tuned regions through"
BLOCK_END = "_nightshift_install(globals())"
KERNELS_SUFFIX = "_nightshift"


# -- winners ------------------------------------------------------------------------------
@dataclass
class Winner:
    region: str
    """Problem name (folder name)."""
    region_class: str
    """Qualified name of the module class whose forward is replaced."""
    candidate_hash: str
    source: str
    speedup: float | None = None
    error: float | None = None
    tolerance: str = ""
    timing: str = ""
    """`cpu`, or the GPU generations it was timed on."""
    planner: str = ""
    template: str | None = None
    chosen_by: str = "store"
    """`integration` (kept end to end) or `store` (best kept candidate; no integration.json)."""


@dataclass
class ApplyResult:
    run: str
    run_id: str
    model_file: str
    kernels_module: str
    patch_path: str
    patch: str
    chosen_by: str
    regions: list[dict] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    already_applied: bool = False
    kernels_module_changed: bool = False
    dry_run: bool = False
    written: list[str] = field(default_factory=list)
    would_write: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    apply_command: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def _candidate_source(run: RunFolder, digest: str, path: str) -> str:
    """The candidate's source by hash from the run's candidates/ folder (canonical), else the
    recorded path; its hash must match (a candidate edited after the run is not the winner)."""
    from tools.trial import Candidate
    tried = [run.candidates_dir / f"{digest}.py"]
    if path:
        p = Path(path)
        tried += [p] if p.is_absolute() else [run.path / p, Path.cwd() / p]
    for p in tried:
        if p.is_file():
            source = p.read_text()
            if Candidate(region="", source=source).hash != digest:
                raise CandidateSkipped(f"candidate {digest}: {p} no longer matches its hash")
            return source
    raise CandidateSkipped(f"candidate {digest}: source not found (looked in {run.candidates_dir})")


def _resolve_regions(problems: list[Problem], wanted: list[str] | None, run: RunFolder) -> list[Problem]:
    if not wanted:
        return problems
    by_name = {p.name: p for p in problems} | {p.region_class: p for p in problems}
    chosen = []
    for name in wanted:
        if name not in by_name:
            known = ", ".join(p.name for p in problems) or "none"
            raise UserError(f"run {run.run_id} has no region {name!r} (regions: {known})")
        if by_name[name] not in chosen:
            chosen.append(by_name[name])
    return chosen


def select_winners(run: RunFolder, regions: list[str] | None = None
                   ) -> tuple[list[Winner], dict[str, str], str]:
    """(winners in the run's problem order, {region: why it has none}, 'integration'|'store')."""
    from agent.loop import load_history
    problems = run.problems()
    if not problems:
        raise UserError(f"{run.path}: the run has no frozen problems")
    chosen = _resolve_regions(problems, regions, run)
    history = load_history(run, problems, [])
    integration = IntegrationResult.load(run.path)
    chosen_by = "integration" if integration is not None else "store"
    winners, skipped = [], {}
    for p in chosen:
        try:
            if integration is not None:
                acc = next((a for a in integration.accepted if a.region == p.name), None)
                if acc is None:
                    why = next((d.reason for d in integration.dropped if d.region == p.name), "")
                    raise CandidateSkipped("not kept end to end by integration" + (f": {why}" if why else ""))
                rec = history.records.get((p.name, acc.candidate_hash))
                digest, path = acc.candidate_hash, acc.candidate_path
                speedup = acc.region_speedup
                planner, template = acc.planner, acc.template
            else:
                rec = history.best(p.name)
                if rec is None:
                    tried = len(history.region_records(p.name))
                    raise CandidateSkipped(f"no kept candidate: {tried} tried, none kept" if tried
                                           else "no candidate tried")
                digest, path, speedup = rec.candidate_hash, "", None
                planner, template = rec.planner, rec.template
            gens = history.targets(p.name)
            trials = list(rec.by_generation.values()) if rec is not None else []
            if rec is not None:
                speedup = speedup if speedup is not None else (rec.score(gens) or None)
                path = path or next((t.candidate_path for t in trials if t.candidate_path), "")
            errors = [t.error for t in trials if t.error is not None]
            winners.append(Winner(
                region=p.name, region_class=p.region_class, candidate_hash=digest,
                source=_candidate_source(run, digest, path), speedup=speedup,
                error=max(errors) if errors else None, tolerance=str(p.tolerance),
                timing=", ".join(sorted({t.generation for t in trials})) or p.device,
                planner=planner, template=template, chosen_by=chosen_by))
        except CandidateSkipped as e:
            skipped[p.name] = str(e)
    return winners, skipped, chosen_by


# -- the model patch ----------------------------------------------------------------------
def routing_block(kernels_file: str, run_id: str) -> list[str]:
    return [
        f"{BLOCK_MARK} {kernels_file} (run {run_id})",
        "# Loaded by file path from next to this file rather than by `import`: that works however",
        "# this file is imported (by path under another module name, as KernelBench harnesses and",
        "# nightshift do, from a package, or run as a script), whatever characters its name holds,",
        "# and never picks up a same-named module elsewhere on sys.path. NIGHTSHIFT_DISABLE=1 keeps",
        "# the original forwards.",
        "def _nightshift_install(namespace):",
        "    import hashlib, importlib.util, os, sys",
        f"    path = os.path.join(os.path.dirname(os.path.realpath(__file__)), {kernels_file!r})",
        "    name = 'nightshift_kernels_' + hashlib.sha256(path.encode()).hexdigest()[:16]",
        "    module = sys.modules.get(name)",
        "    if module is None:",
        "        spec = importlib.util.spec_from_file_location(name, path)",
        "        module = importlib.util.module_from_spec(spec)",
        "        sys.modules[name] = module  # registered before it runs, as `import` does",
        "        try:",
        "            spec.loader.exec_module(module)",
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


def patched_lines(text: str, kernels_file: str, run_id: str, path: Path) -> tuple[list[str], list[str]]:
    """(old lines, new lines) of the model file, with ends kept."""
    nl = "\r\n" if "\r\n" in text else "\n"
    old = text.splitlines(keepends=True)
    block = [ln + nl for ln in routing_block(kernels_file, run_id)]
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


def _model_unchanged(lines: list[str], want_hash: str) -> bool:
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


# -- the command --------------------------------------------------------------------------
def apply_run(run_path: Path, regions: list[str] | None = None, dry_run: bool = False) -> ApplyResult:
    run = RunFolder.open(run_path)
    info = run.info()
    model = Path(info.model_file)
    if not model.is_absolute():
        model = (run.path / model) if (run.path / model).is_file() else Path.cwd() / model
    if not model.is_file():
        raise UserError(f"{model}: the run's model file is not there any more (run.json model_file)")
    model = model.resolve()
    winners, skipped, chosen_by = select_winners(run, regions)
    integration = IntegrationResult.load(run.path)
    kernels_name = f"{model.stem}{KERNELS_SUFFIX}.py"
    kernels_path = model.parent / kernels_name
    patch_path = run.path / "patches" / f"{model.stem}.patch"
    result = ApplyResult(run=str(run.path), run_id=run.run_id, model_file=str(model),
                         kernels_module=str(kernels_path), patch_path=str(patch_path), patch="",
                         chosen_by=chosen_by, skipped=skipped, dry_run=dry_run)
    if not winners:
        return result
    text, parts, unmergeable = kernels_module_text(winners, run.run_id, model.name, integration)
    skipped.update(unmergeable)
    if not parts:
        return result
    result.regions = [{"region": p.winner.region, "class": p.winner.region_class,
                       "candidate_hash": p.winner.candidate_hash, "forward": p.forward,
                       "speedup": p.winner.speedup, "error": p.winner.error, "tolerance": p.winner.tolerance,
                       "renamed": p.renames} for p in parts]
    with open(model, newline="") as f:
        model_text = f.read()
    old, new = patched_lines(model_text, kernels_name, run.run_id, model)
    if not _model_unchanged(old, info.model_hash):
        result.warnings.append(f"{model.name} changed since the run froze it; the tuned regions were verified "
                               "against the earlier version")
    result.patch = unified_patch(old, new, model.name)
    result.already_applied = not result.patch
    current = kernels_path.read_text() if kernels_path.is_file() else None
    result.kernels_module_changed = current != text
    result.apply_command = f"git -C {model.parent} apply {patch_path}" if result.patch else ""
    targets = [(kernels_path, text), (patch_path, result.patch)]
    if dry_run:
        result.would_write = [str(p) for p, _ in targets]
        return result
    patch_path.parent.mkdir(parents=True, exist_ok=True)
    for path, content in targets:
        if not path.is_file() or path.read_text() != content:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(content)
            tmp.replace(path)
        result.written.append(str(path))
    return result
