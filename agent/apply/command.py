"""`agent apply RUN`: the winners as files the user commits next to their model.

Two things come out of a run:

- `<model_dir>/<model_stem>_nightshift.py`, ONE module holding every winning candidate, merged
  with `ast` (agent/apply/merge.py), ending with `install(namespace)` (agent/apply/routing.py);
- `<run>/patches/<model_stem>.patch`, a unified diff that appends one marked block to the
  model file (agent/apply/patch.py): it loads the kernels module by path from next to the
  model file and calls `install(globals())`. `git apply` it from the model file's directory.

Region classes defined outside the model file (transformers' modules in site-packages) are
routed at run time by `install()`; their files are never edited. Winners: agent/apply/winners.py.
Applying twice is harmless: a model file that already carries the block needs no patch (the
patch written the first time is kept), and the kernels module is rewritten byte for byte the
same.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

from agent.apply.merge import kernels_module_text
from agent.apply.patch import model_unchanged, patched_lines, unified_patch
from agent.apply.winners import NOT_FASTER, Winner, load_integration, select_winners
from agent.errors import UserError
from tools.problem import Problem
from tools.corpus import CorpusFolder, is_corpus
from tools.runfolder import RunFolder

KERNELS_SUFFIX = "_nightshift"
KEEPS_DERIVED = re.compile(r"module\.__dict__\[[^\]]+\]\s*=[^=]|module\.\w+\s*=[^=]")
"""A candidate that stores something on the module (a cached concatenated weight: `_cached_cat`)."""


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
    """The command that applies the patch, with absolute paths: it works from any directory."""
    kernels_module_source: str = ""
    """The code of `kernels_module`, as written (or, in a dry run, as it would be)."""
    note: str = ""
    """Why there is nothing to apply (empty when there is): a verdict, not an error."""

    def to_json(self) -> dict:
        return asdict(self)

    def lines(self) -> tuple[list[str], list[str]]:
        """(what `agent apply` prints on stdout, the warnings for stderr)."""
        source = "as integration decided (integration.json)" if self.chosen_by == "integration" else \
            "best kept candidate per region (no integration.json)"
        out = [f"run {self.run_id}: {len(self.regions)} region(s) to apply, {source}"]
        for r in self.regions:
            speed = f"{r['speedup']:.2f}x" + (" (CPU timing)" if r.get("timing") == "cpu" else "") if r["speedup"] \
                else "n/a"
            error = f"{r['error']:.3g}" if r["error"] is not None else "n/a"
            where = f", class from {r['class_module']} (routed at run time)" if r.get("class_module") else ""
            slower = " (not faster: --allow-slower)" if r.get("chosen_by") == "integration-slower" else ""
            out.append(f"  {r['region']}: candidate {r['candidate_hash']}, {speed}{slower}, error {error} vs "
                       f"{r['tolerance']}{where}")
            if shapes := r.get("under_compile"):  # integration found torch.compile of the region as fast there
                which = "every call" if "*" in shapes else f"{len(shapes)} input shape(s)"
                out.append(f"    under compile_model its own code runs on {which}: torch.compile of it was as fast")
        out += [f"  {name}: not applied ({why})" for name, why in self.skipped.items()]
        warnings = [f"warning: {w}" for w in self.warnings]
        if not self.regions:
            return out + [self.note], warnings
        routed = Path(self.kernels_module).name
        if self.dry_run:  # everything it would write, the code itself included
            code = self.kernels_module_source.rstrip("\n")
            out += [f"--- the kernels module it would write, {self.kernels_module} ({code.count(chr(10)) + 1} lines):",
                    code, "--- end of the kernels module"]
            out += [f"--- the patch to {Path(self.model_file).name} it would write, {self.patch_path} (apply it: "
                    f"{self.apply_command}):", self.patch.rstrip("\n"), "--- end of the patch"] if self.patch else [
                f"{self.model_file} already routes through {routed} (already applied): the patch is empty"]
            return out + [f"would write {p}" for p in self.would_write], warnings
        out += [f"wrote {p}" for p in self.written]
        if self.already_applied:
            out.append(f"{self.model_file} already routes through {routed} (already applied): nothing to patch; "
                       f"the patch that applied stays in {self.patch_path}" if Path(self.patch_path).is_file()
                       else f"{self.model_file} already routes through {routed} (already applied): nothing to patch")
        else:
            out.append(f"apply it: {self.apply_command}")
        mod = Path(self.kernels_module).stem
        out.append(f"under torch.compile: model = {mod}.compile_model(model, *example_inputs, mode=...) "
                   "(our kernels as opaque ops the compiler fuses around; plain torch.compile(model) works too, "
                   "tracing into them)")
        return out, warnings


def _nothing_to_apply(skipped: dict[str, str], cpu: bool, run: Path) -> str:
    """The line for a run with no winner to apply: a verdict (exit 1), not an error."""
    if any(NOT_FASTER in why for why in skipped.values()):
        why = ("no region has a candidate faster than the original beyond its noise band"
               + (" (the expected result on a CPU, which measures correctness, not GPU speed)" if cpu else ""))
        return (f"nothing to apply: {why}; each region's reason is above. Not an error: agent apply {run} --dry-run "
                "--allow-slower shows the patch of the verified candidates anyway")
    return "nothing to apply: no region has a kept candidate (each region's reason is above)"


def class_modules(model: Path, problems: list[Problem]) -> tuple[dict[str, str], list[str]]:
    """{region: module name} for region classes defined outside the model file, and warnings
    for classes not found. A class the model file defines or imports is found in its globals;
    any other (a transformers model's layers) on the model built on the meta device (cheap at
    any size). Importing the model file runs the user's own code, as running their model does."""
    import torch

    from tools.modelfile import import_model_file
    try:
        module = import_model_file(model)
    except (Exception, SystemExit) as e:  # the user's own code: anything can go wrong
        return {}, [f"{model.name} could not be imported to find where its region classes live "
                    f"({type(e).__name__}: {str(e)[:200]})"]
    out, unresolved = {}, []
    for p in problems:
        cls = module
        for part in p.region_class.split("."):
            cls = getattr(cls, part, None)
        if isinstance(cls, type):
            if cls.__module__ != module.__name__:
                out[p.name] = cls.__module__
        else:
            unresolved.append(p)
    if not unresolved:
        return out, []
    try:
        with torch.device("meta"):
            built = module.Model(*module.get_init_inputs())
    except (Exception, SystemExit) as e:
        return out, [f"{', '.join(p.region_class for p in unresolved)}: not defined in {model.name}, and the model "
                     f"could not be built to find them ({type(e).__name__}: {str(e)[:200]}); not routed"]
    warnings = []
    for p in unresolved:
        try:
            cls = type(built.get_submodule(p.region_path)) if p.region_path else type(built)
        except AttributeError:
            cls = None
        if cls is None or cls.__qualname__ != p.region_class:
            warnings.append(f"{p.region_class}: no such class at {p.region_path or 'the model'} in {model.name}; "
                            "not routed")
        else:
            out[p.name] = cls.__module__
    return out, warnings


def _write(path: Path, content: str) -> None:
    if not path.is_file() or path.read_text() != content:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(content)
        tmp.replace(path)


def apply_run(run_path: Path, regions: list[str] | None = None, dry_run: bool = False,
              allow_slower: bool = False) -> ApplyResult:
    if is_corpus(run_path):  # each model of a corpus has its own run, winners and patch
        runs = CorpusFolder.open(run_path).runs()
        raise UserError(f"{run_path} is a corpus: apply each model's run, e.g. "
                        + "; ".join(f"agent apply {run.path} --dry-run" for run in runs.values())
                        if runs else f"{run_path} is a corpus whose models were not frozen yet: nothing to apply")
    run = RunFolder.open(run_path)
    info = run.info()
    model = Path(info.model_file)
    if not model.is_absolute():
        model = (run.path / model) if (run.path / model).is_file() else Path.cwd() / model
    if not model.is_file():
        raise UserError(f"{model}: the run's model file is not there any more (run.json model_file)")
    model = model.resolve()
    run.check_store()
    winners, skipped, chosen_by, warnings = select_winners(run, regions, allow_slower)
    integration = load_integration(run)
    kernels_name = f"{model.stem}{KERNELS_SUFFIX}.py"
    kernels_path = model.parent / kernels_name
    patch_path = run.path.resolve() / "patches" / f"{model.stem}.patch"
    result = ApplyResult(run=str(run.path), run_id=run.run_id, model_file=str(model),
                         kernels_module=str(kernels_path), patch_path=str(patch_path), patch="",
                         chosen_by=chosen_by, skipped=skipped, dry_run=dry_run, warnings=warnings)
    if not winners:
        result.note = _nothing_to_apply(skipped, info.device == "cpu", run.path)
        return result
    outside, notes = class_modules(model, [p for p in run.problems() if p.name in {w.region for w in winners}])
    result.warnings += notes
    winners = [Winner(**{**asdict(w), "class_module": outside.get(w.region)}) for w in winners]
    text, parts, unmergeable = kernels_module_text(winners, run.run_id, model.name, integration)
    skipped.update(unmergeable)
    result.kernels_module_source = text
    if not parts:
        result.note = _nothing_to_apply(skipped, info.device == "cpu", run.path)
        return result
    result.regions = [{"region": p.winner.region, "class": p.winner.region_class,
                       "class_module": p.winner.class_module, "candidate_hash": p.winner.candidate_hash,
                       "forward": p.forward, "speedup": p.winner.speedup, "error": p.winner.error,
                       "tolerance": p.winner.tolerance, "renamed": p.renames, "chosen_by": p.winner.chosen_by,
                       "under_compile": p.winner.under_compile, "timing": p.winner.timing}
                      for p in parts]
    with open(model, newline="") as f:
        model_text = f.read()
    derived = [p.winner.region for p in parts if KEEPS_DERIVED.search(p.winner.source)]
    old, new = patched_lines(model_text, kernels_name, run.run_id, model, derived)
    if not model_unchanged(old, info.model_hash):
        result.warnings.append(f"{model.name} changed since the run froze it; the tuned regions were verified "
                               "against the earlier version")
    result.patch = unified_patch(old, new, model.name)
    result.already_applied = not result.patch
    current = kernels_path.read_text() if kernels_path.is_file() else None
    result.kernels_module_changed = current != text
    if result.patch:
        result.apply_command = f"git -C {shlex.quote(str(model.parent))} apply {shlex.quote(str(patch_path))}"
    # An empty patch (the model carries the block already) never replaces the one that applied.
    targets = [(kernels_path, text)] + ([(patch_path, result.patch)] if result.patch else [])
    if dry_run:
        result.would_write = [str(p) for p, _ in targets]
        return result
    try:
        patch_path.parent.mkdir(parents=True, exist_ok=True)
        for path, content in targets:
            _write(path, content)
            result.written.append(str(path))
    except OSError as e:
        raise UserError(f"{e.filename or model.parent}: cannot write ({e.strerror}); nothing else was changed") \
            from None
    return result
