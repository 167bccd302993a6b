"""`agent apply RUN`: the winners as files the user commits next to their model.

Two things come out of a run:

- `<model_dir>/<model_stem>_nightshift.py`, ONE module holding every winning candidate. Each
  candidate file defines `forward` and its own Triton kernels, often with the same names as
  another's (`_kernel`, `BLOCK`, `forward`), so they are merged with `ast`: every name a
  candidate binds at module level is renamed to a region-specific one (`_rmsnorm` ->
  `_LlamaRMSNorm__rmsnorm`, `forward` -> `forward_LlamaRMSNorm`) and every reference that
  resolves to it is rewritten, scope-aware (a kernel parameter or a local that happens to
  share a global's name is left alone; attribute names like `module.weight` are never
  touched). Imports are hoisted and deduplicated. The module ends with `REGIONS`, `CLASSES`
  and `install(namespace)`, which points each region class's `forward` at its tuned forward.
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
import builtins
import difflib
import hashlib
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from agent.jobs import UserError
from tools.e2e import IntegrationResult
from tools.problem import Problem
from tools.runfolder import RunFolder

BLOCK_MARK = "# nightshift: route tuned regions through"
BLOCK_END = "_nightshift_install(globals())"
KERNELS_SUFFIX = "_nightshift"
# Module-level names the generated routing code owns; candidates' names are renamed around them.
RESERVED = {"REGIONS", "CLASSES", "install", "_nightshift_route", "_nightshift_os", "_nightshift_torch",
            "_nightshift_warnings"}


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
                raise _Skip(f"candidate {digest}: {p} no longer matches its hash")
            return source
    raise _Skip(f"candidate {digest}: source not found (looked in {run.candidates_dir})")


class _Skip(Exception):
    pass


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
                    raise _Skip("not kept end to end by integration" + (f": {why}" if why else ""))
                rec = history.records.get((p.name, acc.candidate_hash))
                digest, path = acc.candidate_hash, acc.candidate_path
                speedup = acc.region_speedup
                planner, template = acc.planner, acc.template
            else:
                rec = history.best(p.name)
                if rec is None:
                    tried = len(history.region_records(p.name))
                    raise _Skip(f"no kept candidate: {tried} tried, none kept" if tried else "no candidate tried")
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
        except _Skip as e:
            skipped[p.name] = str(e)
    return winners, skipped, chosen_by


# -- merging candidates -------------------------------------------------------------------
def _identifier(name: str) -> str:
    out = re.sub(r"\W", "_", name)
    return out if out.isidentifier() else f"R{out}"


def _import_binding(alias: ast.alias, is_from: bool) -> str:
    if alias.asname:
        return alias.asname
    return alias.name if is_from else alias.name.split(".")[0]


class _Binder(ast.NodeVisitor):
    """Names bound directly in one scope, not in the scopes nested inside it."""

    def __init__(self) -> None:
        self.bound: set[str] = set()
        self.globals: set[str] = set()
        self.nonlocals: set[str] = set()

    def run(self, nodes) -> "_Binder":
        for n in nodes:
            self.visit(n)
        return self

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            self.bound.add(node.id)

    def _outer_parts_of_function(self, args: ast.arguments) -> None:
        for d in args.defaults + [d for d in args.kw_defaults if d is not None]:
            self.visit(d)

    def visit_FunctionDef(self, node) -> None:
        self.bound.add(node.name)
        for d in node.decorator_list:
            self.visit(d)
        self._outer_parts_of_function(node.args)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.bound.add(node.name)
        for d in node.decorator_list + node.bases + [k.value for k in node.keywords]:
            self.visit(d)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._outer_parts_of_function(node.args)

    def _comprehension(self, node) -> None:
        self.visit(node.generators[0].iter)  # the first iterable is evaluated out here
        for n in ast.walk(node):  # walrus targets inside a comprehension bind out here
            if isinstance(n, ast.NamedExpr) and isinstance(n.target, ast.Name):
                self.bound.add(n.target.id)

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension

    def visit_Import(self, node: ast.Import) -> None:
        self.bound.update(_import_binding(a, False) for a in node.names)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.bound.update(_import_binding(a, True) for a in node.names if a.name != "*")

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name:
            self.bound.add(node.name)
        self.generic_visit(node)

    def visit_Global(self, node: ast.Global) -> None:
        self.globals.update(node.names)

    def visit_Nonlocal(self, node: ast.Nonlocal) -> None:
        self.nonlocals.update(node.names)

    def _capture(self, node) -> None:
        if getattr(node, "name", None):
            self.bound.add(node.name)
        if getattr(node, "rest", None):
            self.bound.add(node.rest)
        self.generic_visit(node)

    visit_MatchAs = visit_MatchStar = visit_MatchMapping = _capture


@dataclass
class _Scope:
    kind: str  # function | class | comprehension
    local: set[str]
    globals: set[str] = field(default_factory=set)
    nonlocals: set[str] = field(default_factory=set)


def _function_scope(node) -> _Scope:
    a = node.args
    params = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x is not None}
    body = [node.body] if isinstance(node, ast.Lambda) else node.body
    b = _Binder().run(body)
    return _Scope("function", (b.bound | params) - b.globals - b.nonlocals, b.globals, b.nonlocals)


class _Renamer(ast.NodeTransformer):
    """Rewrites every name that resolves to the module scope and is in `mapping`."""

    def __init__(self, mapping: dict[str, str]):
        self.map = mapping
        self.stack: list[_Scope] = []

    def _new(self, name: str) -> str | None:
        for i in range(len(self.stack) - 1, -1, -1):
            s = self.stack[i]
            if s.kind == "class" and i != len(self.stack) - 1:
                continue  # class bodies are not visible from the functions nested in them
            if name in s.globals:
                break
            if name in s.nonlocals:
                continue
            if name in s.local:
                return None
        return self.map.get(name)

    def _stmts(self, body: list) -> list:
        out = []
        for stmt in body:
            new = self.visit(stmt)
            out.extend(new if isinstance(new, list) else [new] if new is not None else [])
        return out

    def visit_Name(self, node: ast.Name):
        new = self._new(node.id)
        if new:
            node.id = new
        return node

    def _outer_args(self, args: ast.arguments) -> None:
        for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]:
            if a is not None and a.annotation is not None:
                a.annotation = self.visit(a.annotation)
        args.defaults = [self.visit(d) for d in args.defaults]
        args.kw_defaults = [self.visit(d) if d is not None else None for d in args.kw_defaults]

    def visit_FunctionDef(self, node):
        new = self._new(node.name)
        if new:
            node.name = new
        node.decorator_list = [self.visit(d) for d in node.decorator_list]
        self._outer_args(node.args)
        if node.returns is not None:
            node.returns = self.visit(node.returns)
        self.stack.append(_function_scope(node))
        node.body = self._stmts(node.body)
        self.stack.pop()
        return node

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda):
        self._outer_args(node.args)
        self.stack.append(_function_scope(node))
        node.body = self.visit(node.body)
        self.stack.pop()
        return node

    def visit_ClassDef(self, node: ast.ClassDef):
        new = self._new(node.name)
        if new:
            node.name = new
        node.decorator_list = [self.visit(d) for d in node.decorator_list]
        node.bases = [self.visit(b) for b in node.bases]
        node.keywords = [self.visit(k) for k in node.keywords]
        b = _Binder().run(node.body)
        self.stack.append(_Scope("class", b.bound - b.globals - b.nonlocals, b.globals, b.nonlocals))
        node.body = self._stmts(node.body)
        self.stack.pop()
        return node

    def _comprehension(self, node):
        first = node.generators[0]
        first.iter = self.visit(first.iter)
        targets = {n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}
        self.stack.append(_Scope("comprehension", targets))
        for i, g in enumerate(node.generators):
            g.target = self.visit(g.target)
            if i:
                g.iter = self.visit(g.iter)
            g.ifs = [self.visit(x) for x in g.ifs]
        for attr in ("elt", "key", "value"):
            if hasattr(node, attr):
                setattr(node, attr, self.visit(getattr(node, attr)))
        self.stack.pop()
        return node

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension

    def visit_Global(self, node: ast.Global):
        node.names = [self.map.get(n, n) for n in node.names]
        return node

    def visit_ExceptHandler(self, node: ast.ExceptHandler):
        if node.name and (new := self._new(node.name)):
            node.name = new
        return self.generic_visit(node)

    def _capture(self, node):
        for attr in ("name", "rest"):
            if getattr(node, attr, None) and (new := self._new(getattr(node, attr))):
                setattr(node, attr, new)
        return self.generic_visit(node)

    visit_MatchAs = visit_MatchStar = visit_MatchMapping = _capture

    def visit_Import(self, node: ast.Import):
        out = []
        for a in node.names:
            new = self._new(_import_binding(a, False))
            out.append(_import_as(a, new) if new else ast.Import(names=[a]))
        return out

    def visit_ImportFrom(self, node: ast.ImportFrom):
        for a in node.names:
            if a.name != "*" and (new := self._new(_import_binding(a, True))):
                a.asname = new
        return node


def _import_as(alias: ast.alias, new: str) -> ast.stmt:
    """`import a.b.c` bound to another name: `new = __import__('a.b.c')` binds the top package
    with its submodules loaded, exactly what the plain statement binds to `a`."""
    if alias.asname or "." not in alias.name:
        return ast.Import(names=[ast.alias(alias.name, new)])
    return ast.Assign(targets=[ast.Name(new, ast.Store())],
                      value=ast.Call(ast.Name("__import__", ast.Load()), [ast.Constant(alias.name)], []),
                      lineno=0)


def _is_main_guard(stmt: ast.stmt) -> bool:
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


def merge_candidates(winners: list[Winner]) -> tuple[list[str], list[str], list[_Part]]:
    """(future imports, hoisted imports, per-winner renamed bodies) as text and ASTs."""
    trees = []
    for w in winners:
        try:
            trees.append(ast.parse(w.source, filename=f"{w.region}/{w.candidate_hash}.py"))
        except SyntaxError as e:
            raise _Skip(f"candidate {w.candidate_hash} does not parse: {e}") from None
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
        body = [s for s in body if not _is_main_guard(s) and not (
            isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in s.targets))]
        top_imports = [s for s in body if isinstance(s, (ast.Import, ast.ImportFrom))]
        rest = [s for s in body if not isinstance(s, (ast.Import, ast.ImportFrom))]
        bound = _Binder().run(rest).bound
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
                name = _import_binding(a, isinstance(stmt, ast.ImportFrom))
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
                        emit(_import_as(a, new))
        for name in sorted(bound):
            renames[name] = fresh(name, region)
        if "forward" not in bound:
            raise _Skip("the candidate defines no module-level `forward`")
        renamer = _Renamer(renames)
        new_body = renamer._stmts(kept_in_place + rest)
        parts.append(_Part(w, new_body, {k: v for k, v in renames.items() if k in bound}, renames["forward"]))
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


ROUTING = '''

def _nightshift_route(cls, region, tuned):
    """Point cls.forward at `tuned`; installing again replaces the routing, never wraps it."""
    current = cls.__dict__.get("forward")
    original = getattr(current, "__nightshift_original__", None) or cls.forward

    def forward(self, *args, **kwargs):
        # Instances of subclasses were never verified, and the tuned kernels define no backward
        # and were verified for inference only: those calls keep the original forward.
        if type(self) is not cls or (self.training and _nightshift_torch.is_grad_enabled()):
            return original(self, *args, **kwargs)
        return tuned(self, *args, **kwargs)

    forward.__nightshift_original__ = original
    forward.__nightshift_region__ = region
    forward.__doc__ = f"nightshift: {cls.__qualname__}.forward routed through {tuned.__name__}"
    cls.forward = forward


def install(namespace: dict) -> list[str]:
    """Route every region class found in `namespace` (the model module's globals) through its
    tuned forward; returns the routed class names. NIGHTSHIFT_DISABLE=1 routes nothing."""
    if _nightshift_os.environ.get("NIGHTSHIFT_DISABLE", "").strip() not in ("", "0"):
        return []
    routed = []
    for region, qualname in CLASSES.items():
        head, *rest = qualname.split(".")
        cls = namespace.get(head)
        for part in rest:
            cls = getattr(cls, part, None)
        if not isinstance(cls, type):
            _nightshift_warnings.warn(f"nightshift: no class {qualname} in the model; {region} not routed",
                                      stacklevel=2)
            continue
        _nightshift_route(cls, region, REGIONS[region])
        routed.append(qualname)
    return routed
'''


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
        except _Skip as e:
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
    text += "\n" + "\n".join(imports + ["import os as _nightshift_os", "import torch as _nightshift_torch",
                                        "import warnings as _nightshift_warnings"]) + "\n"
    if integration is not None and integration.workloads:
        text += "\n# End to end (integration.json, " + ("CPU timing" if integration.timing_kind == "cpu" else
                                                        f"GPU timing on {integration.generation or integration.device}") + "):\n"
        for wl in integration.workloads:
            text += (f"#   {wl.name}: {_fmt(wl.eager_ms, '.4g')} ms -> {_fmt(wl.tuned_ms, '.4g')} ms "
                     f"({_fmt(wl.speedup, '.2f')}x), error {_fmt(wl.error, '.3g')} vs {wl.tolerance or 'n/a'}\n")
    for part in parts:
        w = part.winner
        timing = "CPU timing" if w.timing in ("", "cpu") else f"timed on {w.timing}"
        origin = ("kept end to end by integration" if w.chosen_by == "integration"
                  else "best kept candidate in the run's store")
        how = ", ".join(x for x in (f"planner {w.planner}" if w.planner else "",
                                     f"template {w.template}" if w.template else "") if x)
        renamed = ", ".join(f"{k} -> {v}" for k, v in sorted(part.renames.items()))
        lines = [f"{w.region} (class {w.region_class}): candidate {w.candidate_hash}" + (f" ({how})" if how else ""),
                 f"speedup {_fmt(w.speedup, '.2f')}x over the original forward (weighted over workloads, {timing})",
                 f"error {_fmt(w.error, '.3g')} vs tolerance {w.tolerance}",
                 f"run {run_id}: {origin}",
                 f"renamed: {renamed}"]
        text += "\n\n" + "# " + "=" * 88 + "\n" + "".join(f"# {x}\n" for x in lines) + "# " + "=" * 88 + "\n\n"
        text += _statements(part.body)
    text += "\n\n" + "# " + "=" * 88 + "\n# Routing: the model file calls install(globals()).\n\n"
    text += "REGIONS = {" + ", ".join(f"{p.winner.region!r}: {p.forward}" for p in parts) + "}\n"
    text += '"""Region -> its tuned forward(module, *inputs)."""\n'
    text += "CLASSES = {" + ", ".join(f"{p.winner.region!r}: {p.winner.region_class!r}" for p in parts) + "}\n"
    text += '"""Region -> qualified name of the module class whose forward it replaces."""\n'
    text += ROUTING
    tree = ast.parse(text)  # what we write must at least parse, with one definition per name
    names = [t.id for s in tree.body if isinstance(s, ast.Assign) for t in s.targets if isinstance(t, ast.Name)]
    names += [s.name for s in tree.body if isinstance(s, (ast.FunctionDef, ast.ClassDef))]
    dupes = {n for n in names if names.count(n) > 1}
    assert not dupes, f"merged module defines {sorted(dupes)} twice"
    return text, parts, skipped


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
    if tree.body and _is_main_guard(tree.body[-1]):
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
