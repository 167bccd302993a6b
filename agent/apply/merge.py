"""The winning candidates merged into ONE kernels module, for `agent apply` (agent/apply/command.py).

Each candidate file defines `forward` and its own Triton kernels, often with the same names as
another's (`_kernel`, `BLOCK`, `forward`), so they are merged with `ast`: every name a candidate
binds at module level is renamed to a region-specific one (`_rmsnorm` -> `_LlamaRMSNorm__rmsnorm`,
`forward` -> `forward_LlamaRMSNorm`) and every reference that resolves to it is rewritten,
scope-aware (agent/apply/rename.py). Imports are hoisted and deduplicated. The module ends with
`REGIONS`, `CLASSES`, `MODULES`, `NEEDS_GPU` and `install(namespace)` (agent/apply/routing.py),
which points each region class's `forward` at its tuned forward.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import re
from dataclasses import dataclass

from agent.apply.rename import Binder, Renamer, import_as, import_binding
from agent.apply.routing import IMPORTS, RESERVED, ROUTING
from agent.prompting import render_code
from agent.apply.winners import CandidateSkipped, Winner
from tools.e2e import IntegrationResult
from tools.fingerprint import instance_fingerprint


def _identifier(name: str) -> str:
    out = re.sub(r"\W", "_", name)
    return out if out.isidentifier() else f"R{out}"


def is_main_guard(stmt: ast.stmt) -> bool:
    return (isinstance(stmt, ast.If) and isinstance(stmt.test, ast.Compare)
            and isinstance(stmt.test.left, ast.Name) and stmt.test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in stmt.test.comparators))


def _import_key(stmt: ast.stmt, alias: ast.alias) -> tuple:
    """What a hoisted import binds: equal keys bind the same object to the same name."""
    if isinstance(stmt, ast.Import):
        return ("module", alias.name if alias.asname else alias.name.split(".")[0])
    return ("from", stmt.level, stmt.module, alias.name)


@dataclass
class _Part:
    winner: Winner
    body: list[ast.stmt]
    renames: dict[str, str]
    forward: str
    needs_gpu: bool = False
    """The candidate imports Triton: its kernels need a GPU (or Triton's interpreter)."""


def merge_candidates(winners: list[Winner]) -> tuple[list[str], list[str], list[_Part]]:
    """(future imports, hoisted imports, per-winner renamed bodies) as text and ASTs."""
    trees = []
    for w in winners:
        try:
            trees.append(ast.parse(w.source, filename=f"{w.region}/{w.candidate_hash}.py"))
        except SyntaxError as e:
            raise CandidateSkipped(f"candidate {w.candidate_hash} does not parse: {e}") from None
    idents = {n.id for t in trees for n in ast.walk(t) if isinstance(n, ast.Name)}
    idents |= {n.arg for t in trees for n in ast.walk(t) if isinstance(n, ast.arg)}
    taken: dict[str, tuple] = {name: ("reserved",) for name in RESERVED}
    avoid = set(dir(builtins)) | idents
    futures: list[str] = []
    imports: list[str] = []
    seen_imports: set[str] = set()

    def fresh(name: str, region: str) -> str:
        base = f"_{region}_{name}" if name.startswith("_") else f"{name}_{region}"
        new, i = base, 2
        while new in taken or new in avoid:
            new, i = f"{base}_{i}", i + 1
        taken[new] = ("renamed",)
        return new

    def emit(stmt: ast.stmt) -> None:
        text = ast.unparse(stmt)
        if text not in seen_imports:
            seen_imports.add(text)
            imports.append(text)

    parts = []
    for w, tree in zip(winners, trees):
        region = _identifier(w.region)
        body = list(tree.body)
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            body = body[1:]  # the candidate's docstring
        body = [s for s in body if not is_main_guard(s) and not (
            isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in s.targets))]
        top_imports = [s for s in body if isinstance(s, (ast.Import, ast.ImportFrom))]
        rest = [s for s in body if not isinstance(s, (ast.Import, ast.ImportFrom))]
        bound = Binder().run(rest).bound
        bound |= {g for n in ast.walk(tree) if isinstance(n, ast.Global) for g in n.names}
        renames: dict[str, str] = {}
        kept_in_place: list[ast.stmt] = []
        for stmt in top_imports:
            if isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__":
                for a in stmt.names:
                    line = f"from __future__ import {a.name}"
                    if line not in futures:
                        futures.append(line)
                continue
            for a in stmt.names:
                single = (ast.ImportFrom(module=stmt.module, names=[a], level=stmt.level)
                          if isinstance(stmt, ast.ImportFrom) else ast.Import(names=[a]))
                if a.name == "*":
                    emit(single)
                    continue
                name = import_binding(a, isinstance(stmt, ast.ImportFrom))
                if name in bound:  # rebound elsewhere in the candidate: stays in place, renamed with it
                    kept_in_place.append(single)
                    continue
                key = _import_key(stmt, a)
                if taken.get(name, key) == key:
                    taken[name] = key
                    emit(single)
                else:  # the name already means something else in the merged module
                    new = renames.get(name) or fresh(name, region)
                    renames[name] = new
                    if isinstance(single, ast.ImportFrom):
                        single.names = [ast.alias(a.name, new)]
                        emit(single)
                    else:
                        emit(import_as(a, new))
        for name in sorted(bound):
            renames[name] = fresh(name, region)
        if "forward" not in bound:
            raise CandidateSkipped("the candidate defines no module-level `forward`")
        renamer = Renamer(renames)
        new_body = renamer.rename_body(kept_in_place + rest)
        triton = any(a.name.split(".")[0] == "triton" for n in ast.walk(tree) if isinstance(n, ast.Import)
                     for a in n.names) or any(isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0]
                                              == "triton" for n in ast.walk(tree))
        parts.append(_Part(w, new_body, {k: v for k, v in renames.items() if k in bound}, renames["forward"],
                           triton))
    return futures, imports, parts


def _statements(body: list[ast.stmt]) -> str:
    out, prev_def = [], None
    for stmt in body:
        is_def = isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        if out:
            out.append("\n\n\n" if is_def or prev_def else "\n")
        out.append(ast.unparse(ast.fix_missing_locations(stmt)))
        prev_def = is_def
    return "".join(out) + "\n"


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def kernels_module_text(winners: list[Winner], run_id: str, model_name: str,
                        integration: IntegrationResult | None) -> tuple[str, list[_Part], dict[str, str]]:
    """The merged module's text, its parts, and {region: why it was left out} for candidates
    that cannot be merged."""
    skipped: dict[str, str] = {}
    usable = []
    for w in winners:  # one candidate at a time first, so a broken one is reported, not fatal
        try:
            merge_candidates([w])
            usable.append(w)
        except CandidateSkipped as e:
            skipped[w.region] = str(e)
    futures, imports, parts = merge_candidates(usable)
    head = [f'"""Tuned kernels for {model_name}, generated by `agent apply` (nightshift) from run {run_id}.',
            "",
            f"{model_name} routes its regions through the forwards below with one call, install(globals()).",
            "Each region's candidate is merged in with its module-level names renamed to region-specific",
            "ones. Regenerate with `agent apply RUN` rather than editing by hand; set NIGHTSHIFT_DISABLE=1",
            "to run the original forwards.",
            '"""']
    text = "\n".join(head) + "\n"
    if futures:
        text += "\n".join(futures) + "\n"
    text += "\n" + "\n".join(imports + IMPORTS) + "\n"
    if integration is not None and integration.workloads:
        text += "\n# End to end (integration.json, " + ("CPU timing" if integration.timing_kind == "cpu" else
                                                        f"GPU timing on {integration.generation or integration.device}") + "):\n"
        for wl in integration.workloads:
            text += (f"#   {wl.name}: {_fmt(wl.eager_ms, '.4g')} ms -> {_fmt(wl.tuned_ms, '.4g')} ms "
                     f"({_fmt(wl.speedup, '.2f')}x), error {_fmt(wl.error, '.3g')} vs {wl.tolerance or 'n/a'}\n")
    for part in parts:
        w = part.winner
        timing = "CPU timing" if w.timing in ("", "cpu") else f"timed on {w.timing}"
        origin = {"integration": "kept end to end by integration",
                  "integration-slower": "dropped by integration as not faster; applied because of --allow-slower"
                  }.get(w.chosen_by, "best kept candidate in the run's store")
        how = ", ".join(x for x in (f"planner {w.planner}" if w.planner else "",
                                     f"template {w.template}" if w.template else "") if x)
        renamed = ", ".join(f"{k} -> {v}" for k, v in sorted(part.renames.items()))
        lines = [f"{w.region} (class {w.region_class}): candidate {w.candidate_hash}" + (f" ({how})" if how else ""),
                 f"speedup {_fmt(w.speedup, '.2f')}x over the original forward (weighted over workloads, {timing})",
                 f"error {_fmt(w.error, '.3g')} vs tolerance {w.tolerance}",
                 f"run {run_id}: {origin}",
                 f"renamed: {renamed}"]
        if w.class_module:
            lines.append(f"the class is defined in {w.class_module}: routed in this process only, never edited")
        text += "\n\n" + "# " + "=" * 88 + "\n" + "".join(f"# {x}\n" for x in lines) + "# " + "=" * 88 + "\n\n"
        text += _statements(part.body)
    text += "\n\n" + "# " + "=" * 88 + "\n# Routing: the model file calls install(globals()).\n\n"
    text += "REGIONS = {" + ", ".join(f"{p.winner.region!r}: {p.forward}" for p in parts) + "}\n"
    text += '"""Region -> its tuned forward(module, *inputs)."""\n'
    text += "CLASSES = {" + ", ".join(f"{p.winner.region!r}: {p.winner.region_class!r}" for p in parts) + "}\n"
    text += '"""Region -> qualified name of the module class whose forward it replaces."""\n'
    text += "MODULES = {" + ", ".join(f"{p.winner.region!r}: {p.winner.class_module!r}" for p in parts
                                      if p.winner.class_module) + "}\n"
    text += '"""Region -> the module its class is defined in, when not the model file (patched at run time)."""\n'
    text += "KERNEL_CHECKS = {" + ", ".join(f"{p.winner.region!r}: {p.renames['runs_kernel']}" for p in parts
                                            if "runs_kernel" in p.renames) + "}\n"
    text += ('"""Region -> whether a call runs a kernel of ours (not where its winner leaves a shape to the '
             'region\'s own code or to torch.compile of it): compile_model compiles the others itself."""\n')
    text += "UNDER_COMPILE = {" + ", ".join(f"{p.winner.region!r}: {set(p.winner.under_compile)!r}" for p in parts
                                            if p.winner.under_compile) + "}\n"
    text += ('"""Region -> input shapes ("*": every call) where, under torch.compile, its own code runs, compiled '
             'with the rest: integration found torch.compile of the region as fast there."""\n')
    text += "NEEDS_GPU = {" + ", ".join(f"{p.winner.region!r}: {p.needs_gpu!r}" for p in parts) + "}\n"
    text += '"""Region -> whether its forward runs Triton kernels (which need a GPU or TRITON_INTERPRET=1)."""\n'
    text += "VERIFIED = {" + ", ".join(f"{p.winner.region!r}: {{{', '.join(map(repr, sorted(p.winner.verified)))}}}"
                                       for p in parts if p.winner.verified) + "}\n"
    text += ('"""Region -> fingerprints of the instances its winner was verified on: another instance of the class '
             '(other attributes, shapes or dtypes) keeps its original forward."""\n')
    text += "\n\n" + inspect.getsource(instance_fingerprint).replace("def instance_fingerprint(",
                                                                    "def _nightshift_fingerprint(", 1)
    text += "\n\n" + render_code("kernels/_opaque_op.py.j2", p="_nightshift_")
    text += "\n\n" + render_code("kernels/_shape_key.py.j2", p="_nightshift_", torch="_nightshift_torch") + ROUTING
    tree = ast.parse(text)  # what we write must at least parse, with one definition per name
    names = [t.id for s in tree.body if isinstance(s, ast.Assign) for t in s.targets if isinstance(t, ast.Name)]
    names += [s.name for s in tree.body if isinstance(s, (ast.FunctionDef, ast.ClassDef))]
    dupes = {n for n in names if names.count(n) > 1}
    assert not dupes, f"merged module defines {sorted(dupes)} twice"
    return text, parts, skipped
