"""Problem classes across the models of a corpus: regions that compute the same thing.

transformers copies one RMSNorm into many model files under other class names (LlamaRMSNorm,
Qwen2RMSNorm, MistralRMSNorm); a corpus run searches such a class once. Two frozen problems are
one class only when everything that decides what a candidate must compute is the same:

- the code: the region's class without `__init__` (what it built is compared below) and
  `extra_repr`, docstrings and comments dropped, its own name and the names of the code it calls
  replaced by what that code is; and that called code (classes and functions), likewise;
- what one traced call ran (tools/graph.py `computes`): every op in order, its operands' origins
  and shapes, and its plain arguments, so an eps, a scale or an activation read from a config
  object the code does not name still tells two regions apart;
- every parameter and buffer (name, shape, dtype, stride), the scalar attributes (an eps), the
  children's kinds, the signature and the literal arguments of the call;
- every workload's input and output shapes, dtypes and strides (not their names or weights);
- the device, the target generations, declared in-place outputs and seeded calls.

A problem whose call could not be traced, or whose source is unknown, is a class of its own:
a wrong merge would cost a member its search, a missed one only a second search.
"""

from __future__ import annotations

import ast
import hashlib
import textwrap
from dataclasses import dataclass, field

from tools.problem import Problem

SKIPPED_METHODS = ("__init__", "extra_repr")
"""Methods of a region's own class left out of its code: what __init__ built is compared as
parameters, attributes and children; extra_repr only prints."""


def _digest(value: object) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


class _Renamer(ast.NodeTransformer):
    def __init__(self, names: dict[str, str]):
        self.names = names

    def visit_Name(self, node: ast.Name) -> ast.AST:
        node.id = self.names.get(node.id, node.id)
        return node

    def _definition(self, node):
        node.name = self.names.get(node.name, node.name)
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]  # a docstring says nothing of the math
        self.generic_visit(node)
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _definition


def normalised(source: str, names: dict[str, str], skip: tuple[str, ...] = ()) -> str | None:
    """The source's syntax tree without docstrings, comments and layout, with `names` replaced,
    and, in a class, without the methods named in `skip`. None where it does not parse."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except (SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and skip:
            node.body = [b for b in node.body if not (isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))
                                                      and b.name in skip)] or [ast.Pass()]
    return ast.dump(_Renamer(names).visit(tree), annotate_fields=False)


def called_digests(called: dict[str, str]) -> dict[str, str]:
    """Name -> what the code of that name is, whatever it is called: each source with its own
    name as SELF and the other called names as what they are (first as REF, then as the digest
    that gave, so code that calls another copy under another name still matches)."""
    first = {n: _digest(normalised(src, {n: "SELF", **{m: "REF" for m in called if m != n}}))
             for n, src in called.items()}
    return {n: _digest(normalised(src, {n: "SELF", **{m: first[m] for m in called if m != n}}))
            for n, src in called.items()}


def _tensors(specs) -> list[tuple]:
    return [(t.shape, t.dtype, t.stride) for t in specs]


def class_key(problem: Problem) -> str | None:
    """What a candidate for this problem must compute, as a digest; None where that cannot be
    told (no traced call, no source): such a problem is a class of its own."""
    computes = problem.graph.get("computes")
    called = called_digests(problem.called_sources)
    code = normalised(problem.region_source, {problem.region_class.rpartition(".")[2]: "REGION", **called},
                      skip=SKIPPED_METHODS)
    if not computes or code is None or any(d == _digest(None) for d in called.values()):
        return None
    parts = {
        "code": code, "called": sorted(called.values()), "computes": computes,
        "parameters": [(t.name, t.shape, t.dtype, t.stride) for t in problem.parameters],
        "attributes": sorted((k, repr(v)) for k, v in problem.attributes.items()),
        "children": sorted((k, called.get(v, v)) for k, v in problem.children.items()),
        "signature": problem.graph.get("signature"), "literals": problem.graph.get("literals"),
        "workloads": sorted((_tensors(w.inputs), _tensors(w.outputs)) for w in problem.workloads),
        "device": problem.device, "targets": sorted(problem.target_generations),
        "inplace": problem.inplace_inputs, "seeded": problem.seeded_calls,
    }
    return _digest(parts)


@dataclass
class Member:
    model: str
    """The model's name in the corpus."""
    region: str
    """Its problem's name in that model's run."""


@dataclass
class ProblemClass:
    key: str
    """class_key of every member; `own:<model>/<region>` for a problem that matches nothing by rule."""
    members: list[Member] = field(default_factory=list)
    """The leader (searched) first, then the members its winners are verified on."""

    @property
    def leader(self) -> Member:
        return self.members[0]

    @property
    def name(self) -> str:
        return self.leader.region


def group(problems: list[tuple[str, Problem]]) -> list[ProblemClass]:
    """The classes of `problems` ((model, problem) in corpus order), each led by its first member."""
    classes: dict[str, ProblemClass] = {}
    for model, p in problems:
        key = class_key(p) or f"own:{model}/{p.name}"
        classes.setdefault(key, ProblemClass(key)).members.append(Member(model, p.name))
    return list(classes.values())
