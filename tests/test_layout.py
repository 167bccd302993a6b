"""The shape of the code: imports point one way (no import circle anywhere in agent/, sandbox/
and tools/, tools/ imports no agent/ or sandbox/), and the review code lives in two sub-packages
of agent/ with files and functions a reader can take in."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _modules(package: str) -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Every project module `name` imports, at module level or inside a function (an import
    in a function is still a dependency): `from a.b import c` is a.b.c when that is a module."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in out if m in known}


PRODUCT = ("agent", "sandbox", "tools")


def _graph(*packages: str) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports (an import for type checking only counts:
    it ties the two as tightly, and a circle of them is one a reader must untangle)."""
    mods = {m: p for package in packages for m, p in _modules(package).items()}
    return {m: _imports(p, m, set(mods)) - {m} for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(m: str) -> None:
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                found.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_no_import_circles_in_the_product():
    graph = _graph(*PRODUCT)
    assert {"agent.report.view", "sandbox.timed", "tools.store"} <= set(graph)  # every package is seen
    assert _cycles(graph) == []


def test_the_circle_check_sees_circles_through_packages_and_function_level_imports(tmp_path):
    assert _cycles({"a.x": {"a.y"}, "a.y": {"a.x"}}) == [["a.x", "a.y", "a.x"]]
    assert _cycles({"a.x": {"b.y"}, "b.y": {"c.z"}, "c.z": {"a.x"}, "a.w": {"a.x"}}) == [["a.x", "b.y", "c.z", "a.x"]]
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "low.py").write_text("def f():\n    from pkg import high\n")
    (tmp_path / "pkg" / "high.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    from pkg.low import f\n")
    known = {"pkg", "pkg.low", "pkg.high"}
    assert _imports(tmp_path / "pkg" / "low.py", "pkg.low", known) == {"pkg.high"}
    assert _imports(tmp_path / "pkg" / "high.py", "pkg.high", known) == {"pkg.low"}


def test_tools_import_neither_agent_nor_sandbox():
    for name, path in _modules("tools").items():
        every = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                every |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                every.add((node.module or "").split(".")[0])
        assert not every & {"agent", "sandbox"}, name


ROOMS_DOC = ROOT / "docs" / "architecture.md"


def _room_table() -> dict[str, set[str]]:
    """docs/architecture.md's rooms table: room -> the rooms it may import ("every room": all)."""
    text = ROOMS_DOC.read_text()
    rows = text[text.index("| room | owns | may import |"):].split("\n\n")[0].splitlines()[2:]
    table = {}
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        room, allowed = cells[0].strip("`"), cells[2]
        table[room] = {"*"} if allowed == "every room" else \
            {a.strip().split(" ")[0] for a in allowed.split(",") if a.strip()}
    return table


def _room(module: str) -> str:
    """agent.search.loop -> search; agent.errors (agent/'s top level) -> shared."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (ROOT / "agent" / parts[-1]).is_dir() else "shared"


def _against_the_table(graph: dict[str, set[str]], table: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, deps in sorted(graph.items()):
        if not module.startswith("agent.") or module == "agent.__main__":
            continue
        mine = _room(module)
        for dep in sorted(d for d in deps if d.startswith("agent.")):
            theirs = _room(dep)
            if theirs != mine and "*" not in table[mine] and theirs not in table[mine]:
                wrong.append(f"{module} ({mine}) imports {dep} ({theirs})")
    return wrong


def test_every_agent_module_lives_in_a_room_of_the_table_and_imports_by_it():
    table = _room_table()
    assert {"shared", "setup", "search", "review", "report", "apply", "cli", "planners", "executors"} <= set(table)
    graph = _graph("agent")
    rooms = {_room(m) for m in graph if m.startswith("agent.") and m != "agent.__main__"}
    assert rooms <= set(table), rooms - set(table)  # a new room is drawn in the table first
    assert _against_the_table(graph, table) == []
    top = [f.name for f in (ROOT / "agent").glob("*.py")]
    assert len(top) <= 8, top


def test_the_room_check_fails_on_an_import_against_the_table():
    table = {"shared": set(), "search": {"shared"}, "cli": {"*"}}
    graph = {"agent.search.loop": {"agent.history", "agent.cli.view"}, "agent.cli.main": {"agent.search.loop"}}
    assert _against_the_table(graph, table) == ["agent.search.loop (search) imports agent.cli.view (cli)"]


def test_agent_files_stay_short():
    for f in sorted((ROOT / "agent").rglob("*.py")):
        assert len(f.read_text().splitlines()) <= 400, f
    for gone in ("report.py", "report_html.py", "plots.py", "apply.py", "merge.py", "rename.py", "cli.py", "loop.py"):
        assert not (ROOT / "agent" / gone).exists(), gone


LONG_FUNCTION = 80
"""Lines (def to last line) at which a function is split where a name would explain a part."""
STILL_LONG = {
    "agent/cli/session.py:search_and_review": 88,
    "agent/search/loop.py:tune": 139,
    "agent/search/tuning.py:run_tune": 86,
    "agent/setup/jobs.py:profile_and_freeze": 90,
    "sandbox/verify_runs.py:run": 95,
    "tools/capture.py:_freeze_one": 128,
    "tools/verify.py:judge": 112,
}
"""The functions still that long (issue 52, item 4), each at its length today: the list only shrinks."""


def _functions(tree: ast.AST, prefix: str = "") -> dict[str, int]:
    """Every function in `tree`, methods and nested ones too, by qualified name (Class.method,
    outer.inner) -> its length in lines."""
    out = {}
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[prefix + node.name] = node.end_lineno - node.lineno + 1
            out |= _functions(node, f"{prefix}{node.name}.")
        else:
            out |= _functions(node, f"{prefix}{node.name}." if isinstance(node, ast.ClassDef) else prefix)
    return out


def test_no_function_is_too_long_to_read_but_the_ones_listed_and_those_only_shrink():
    long = {f"{path.relative_to(ROOT).as_posix()}:{name}": n for package in PRODUCT
            for path in sorted((ROOT / package).rglob("*.py"))
            for name, n in _functions(ast.parse(path.read_text())).items() if n >= LONG_FUNCTION}
    assert {k: n for k, n in long.items() if k not in STILL_LONG} == {}  # split it where a name explains a part
    assert {k: (STILL_LONG[k], n) for k, n in long.items() if k in STILL_LONG and n > STILL_LONG[k]} == {}
    assert sorted(set(STILL_LONG) - set(long)) == []  # under the limit now, or gone: strike it from the list


def test_the_length_check_sees_methods_and_nested_functions():
    tree = ast.parse("def f():\n    def g():\n        pass\n    return g\n\n\nclass C:\n    async def m(self):\n"
                     "        return 1\n")
    assert _functions(tree) == {"f": 4, "f.g": 2, "C.m": 2}
