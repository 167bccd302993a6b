"""Scope-aware renaming of module-level names in a candidate's AST, for agent/apply/merge.py.

`Renamer` rewrites every reference that resolves to the module scope and is in its mapping: a
kernel parameter or a local that happens to share a global's name is left alone, `global` and
`nonlocal` are followed, class bodies are not visible from the functions nested in them, and
attribute names like `module.weight` are never touched. `Binder` finds the names one scope binds.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field


def import_binding(alias: ast.alias, is_from: bool) -> str:
    """The name an import binds: `import a.b` binds `a`, `from a import b` binds `b`."""
    if alias.asname:
        return alias.asname
    return alias.name if is_from else alias.name.split(".")[0]


class Binder(ast.NodeVisitor):
    """Names bound directly in one scope, not in the scopes nested inside it."""

    def __init__(self) -> None:
        self.bound: set[str] = set()
        self.globals: set[str] = set()
        self.nonlocals: set[str] = set()

    def run(self, nodes) -> "Binder":
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
        self.bound.update(import_binding(a, False) for a in node.names)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.bound.update(import_binding(a, True) for a in node.names if a.name != "*")

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
    b = Binder().run(body)
    return _Scope("function", (b.bound | params) - b.globals - b.nonlocals, b.globals, b.nonlocals)


class Renamer(ast.NodeTransformer):
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

    def rename_body(self, body: list) -> list:
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
        node.body = self.rename_body(node.body)
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
        b = Binder().run(node.body)
        self.stack.append(_Scope("class", b.bound - b.globals - b.nonlocals, b.globals, b.nonlocals))
        node.body = self.rename_body(node.body)
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
            new = self._new(import_binding(a, False))
            out.append(import_as(a, new) if new else ast.Import(names=[a]))
        return out

    def visit_ImportFrom(self, node: ast.ImportFrom):
        for a in node.names:
            if a.name != "*" and (new := self._new(import_binding(a, True))):
                a.asname = new
        return node


def import_as(alias: ast.alias, new: str) -> ast.stmt:
    """`import a.b.c` bound to another name: `new = __import__('a.b.c')` binds the top package
    with its submodules loaded, exactly what the plain statement binds to `a`."""
    if alias.asname or "." not in alias.name:
        return ast.Import(names=[ast.alias(alias.name, new)])
    return ast.Assign(targets=[ast.Name(new, ast.Store())],
                      value=ast.Call(ast.Name("__import__", ast.Load()), [ast.Constant(alias.name)], []),
                      lineno=0)
