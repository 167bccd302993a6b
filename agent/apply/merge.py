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
from dataclasses import dataclass, field

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
    trees = [_parse(w) for w in winners]
    idents = {n.id for t in trees for n in ast.walk(t) if isinstance(n, ast.Name)}
    idents |= {n.arg for t in trees for n in ast.walk(t) if isinstance(n, ast.arg)}
    merged = _Merged(taken={name: ("reserved",) for name in RESERVED}, avoid=set(dir(builtins)) | idents)
    parts = [merged.part(w, tree) for w, tree in zip(winners, trees)]
    return merged.futures, merged.imports, parts


def _parse(w: Winner) -> ast.Module:
    try:
        return ast.parse(w.source, filename=f"{w.region}/{w.candidate_hash}.py")
    except SyntaxError as e:
        raise CandidateSkipped(f"candidate {w.candidate_hash} does not parse: {e}") from None


def _own_statements(tree: ast.Module) -> list[ast.stmt]:
    """The candidate's module-level statements but its docstring, `__main__` block and `__all__`."""
    body = list(tree.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return [s for s in body if not is_main_guard(s) and not (
        isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in s.targets))]


def _imports_triton(tree: ast.Module) -> bool:
    return any(a.name.split(".")[0] == "triton" for n in ast.walk(tree) if isinstance(n, ast.Import)
               for a in n.names) or any(isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0]
                                        == "triton" for n in ast.walk(tree))


@dataclass
class _Merged:
    """The merged module so far: what each of its names means, and its hoisted imports."""
    taken: dict[str, tuple]
    """Name -> what binds it: reserved, renamed, or an import's key (the same import shares it)."""
    avoid: set[str]
    """Builtins and every identifier of the candidates: never a new name."""
    futures: list[str] = field(default_factory=list)
    imports: list[str] = field(default_factory=list)
    seen_imports: set[str] = field(default_factory=set)

    def fresh(self, name: str, region: str) -> str:
        base = f"_{region}_{name}" if name.startswith("_") else f"{name}_{region}"
        new, i = base, 2
        while new in self.taken or new in self.avoid:
            new, i = f"{base}_{i}", i + 1
        self.taken[new] = ("renamed",)
        return new

    def emit(self, stmt: ast.stmt) -> None:
        text = ast.unparse(stmt)
        if text not in self.seen_imports:
            self.seen_imports.add(text)
            self.imports.append(text)

    def part(self, w: Winner, tree: ast.Module) -> _Part:
        """`w`'s candidate in the module: its imports hoisted, each name it binds at module level
        renamed to a region-specific one."""
        region = _identifier(w.region)
        body = _own_statements(tree)
        top_imports = [s for s in body if isinstance(s, (ast.Import, ast.ImportFrom))]
        rest = [s for s in body if not isinstance(s, (ast.Import, ast.ImportFrom))]
        bound = Binder().run(rest).bound
        bound |= {g for n in ast.walk(tree) if isinstance(n, ast.Global) for g in n.names}
        renames: dict[str, str] = {}
        kept_in_place: list[ast.stmt] = []
        for stmt in top_imports:
            kept_in_place += self.hoist(stmt, bound, region, renames)
        for name in sorted(bound):
            renames[name] = self.fresh(name, region)
        if "forward" not in bound:
            raise CandidateSkipped("the candidate defines no module-level `forward`")
        new_body = Renamer(renames).rename_body(kept_in_place + rest)
        return _Part(w, new_body, {k: v for k, v in renames.items() if k in bound}, renames["forward"],
                     _imports_triton(tree))

    def hoist(self, stmt: ast.Import | ast.ImportFrom, bound: set[str], region: str,
              renames: dict[str, str]) -> list[ast.stmt]:
        """Each name `stmt` imports hoisted to the module's imports (under a new name, noted in
        `renames`, where the module already means something else by it); returns those that stay
        in place."""
        if isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__":
            for a in stmt.names:
                line = f"from __future__ import {a.name}"
                if line not in self.futures:
                    self.futures.append(line)
            return []
        kept_in_place: list[ast.stmt] = []
        for a in stmt.names:
            single = (ast.ImportFrom(module=stmt.module, names=[a], level=stmt.level)
                      if isinstance(stmt, ast.ImportFrom) else ast.Import(names=[a]))
            if a.name == "*":
                self.emit(single)
                continue
            name = import_binding(a, isinstance(stmt, ast.ImportFrom))
            if name in bound:  # rebound elsewhere in the candidate: stays in place, renamed with it
                kept_in_place.append(single)
                continue
            key = _import_key(stmt, a)
            if self.taken.get(name, key) == key:
                self.taken[name] = key
                self.emit(single)
            else:  # the name already means something else in the merged module
                new = renames.get(name) or self.fresh(name, region)
                renames[name] = new
                if isinstance(single, ast.ImportFrom):
                    single.names = [ast.alias(a.name, new)]
                    self.emit(single)
                else:
                    self.emit(import_as(a, new))
        return kept_in_place


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
    text = _head(run_id, model_name, futures, imports) + _end_to_end(integration)
    text += "".join(_part_text(part, run_id) for part in parts)
    text += "\n\n" + "# " + "=" * 88 + "\n# Routing: the model file calls install(globals()).\n\n"
    text += _routing_tables(parts)
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


def _head(run_id: str, model_name: str, futures: list[str], imports: list[str]) -> str:
    """The module's docstring and imports."""
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
    return text + "\n" + "\n".join(imports + IMPORTS) + "\n"


def _end_to_end(integration: IntegrationResult | None) -> str:
    """A comment with integration's table per workload, where it ran."""
    if integration is None or not integration.workloads:
        return ""
    timing = "CPU timing" if integration.timing_kind == "cpu" else \
        f"GPU timing on {integration.generation or integration.device}"
    text = f"\n# End to end (integration.json, {timing}):\n"
    for wl in integration.workloads:
        text += (f"#   {wl.name}: {_fmt(wl.eager_ms, '.4g')} ms -> {_fmt(wl.tuned_ms, '.4g')} ms "
                 f"({_fmt(wl.speedup, '.2f')}x), error {_fmt(wl.error, '.3g')} vs {wl.tolerance or 'n/a'}\n")
    return text


def _part_text(part: _Part, run_id: str) -> str:
    """A winner's renamed statements under a banner saying where it came from and what it was renamed."""
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
    return "\n\n" + "# " + "=" * 88 + "\n" + "".join(f"# {x}\n" for x in lines) + "# " + "=" * 88 + "\n\n" + \
        _statements(part.body)


def _routing_tables(parts: list[_Part]) -> str:
    """The tables install() and compile_model read (agent/apply/routing.py), each with its docstring."""
    text = "REGIONS = {" + ", ".join(f"{p.winner.region!r}: {p.forward}" for p in parts) + "}\n"
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
    return text
