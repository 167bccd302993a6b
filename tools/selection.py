"""Which module classes to freeze as regions, from the profile's rows alone, with a reason for
every class that is not chosen.

A region is one module class; a candidate replaces that class's forward in every instance, so
chosen regions never overlap (no instance of one lies inside or around an instance of
another). Within that rule each class gets one of three fates:

- **whole**: the class is a fusion unit. Its instances call only leaf modules (nn.Linear,
  norms, activations: a KernelBench level-2 `Model.forward`, an MLP, an attention), or none at
  all (a level-1 `Model`, an RMSNorm), or it spends a large share of its time in its own ops
  or in leaf modules no finer region could claim (`OWN_SHARE`). The root model is such a class
  too when it qualifies; region path "" then means the model itself.
- **descend**: its parts are the better problems. A decoder layer holds an attention and an
  MLP (composite classes of their own, each at least `min_share` of the model): they are
  chosen instead, and the layer's residual adds stay outside every region. A wrapper, which
  calls one child and runs no op of its own, descends to that child.
- **overlap / coverage / cap**: a whole class that nests with one already chosen, or that
  comes after the chosen ones reach `coverage` or `max_regions`.

User-defined classes come before torch's own (nn.Linear is one cuBLAS call with nothing to
fuse on its own, and choosing it would block the user classes around it), fusion units before
leaf classes that live inside them (GPT-2's Conv1D is in both its attention and its MLP),
then heavier first. Classes under `MIN_REGION_SHARE` of the time are never chosen.
"""

from __future__ import annotations

from collections import defaultdict

from pydantic import BaseModel

from tools.hotspots import ROOT, ClassRow, HotspotRow, ProfileResult

OWN_SHARE = 0.3
"""A class with parts is still taken whole when this share of its time would be left outside
every finer region (its own ops, leaf modules whose class also lives inside the parts)."""
MIN_REGION_SHARE = 0.01
"""Classes below this share of the model's time are never regions: nothing to win there."""


class RegionVerdict(BaseModel):
    """What selection decided about one class, and why (shown when nothing is frozen)."""

    class_name: str
    qualname: str
    share: float
    chosen: bool
    reason: str


def _inside(q: str, p: str) -> bool:
    """Module path q lies strictly below p."""
    return q != p and (p == ROOT or q.startswith(p + "."))


class _Tree:
    """The profile's module rows as a tree, with the facts selection needs per class."""

    def __init__(self, result: ProfileResult, min_share: float, exclude: tuple[str, ...] = ()):
        """`exclude`: classes that cannot be regions (they could not be frozen): never a part that
        hides the class around them, which is then taken whole (TransformerEncoder, where torch's
        fast path hands its layers nested tensors)."""
        self.rows = {r.path: r for r in result.rows}
        self.classes = {c.qualname: c for c in result.by_class}
        self.min_share = min_share
        kids: dict[str, list[HotspotRow]] = defaultdict(list)
        for r in result.rows:
            if r.parent is not None and r.inclusive_ms > 0:
                kids[r.parent].append(r)
        self._kids = kids
        self.composite = {q for q, c in self.classes.items() if not c.container
                          and c.class_name not in exclude and q not in exclude
                          and any(self.called_children(p) for p in c.paths)}
        self._fate: dict[str, tuple[str, str]] = {}
        self._shadowed: dict[tuple[str, frozenset], bool] = {}

    def called_children(self, path: str) -> list[HotspotRow]:
        """Children that ran, looking through containers (ModuleList, Sequential, ...)."""
        out = []
        for r in self._kids.get(path, []):
            out.extend(self.called_children(r.path) if r.container else [r])
        return out

    def own_ops(self, path: str) -> float:
        """Kernel launches (CPU: aten ops) of the module's own code, per forward."""
        return self.rows[path].kernels - sum(ch.kernels for ch in self.called_children(path))

    def parts(self, c: ClassRow) -> list[str]:
        """Composite classes (other than c) of at least min_share with an instance inside c."""
        return sorted({self.classes[q].class_name for q in self.composite if q != c.qualname
                       and self.classes[q].share >= self.min_share
                       and any(_inside(p, a) for p in self.classes[q].paths for a in c.paths)})

    def loose_ms(self, path: str, guard: frozenset) -> float:
        """Time under `path` that no finer region would cover if its class descended."""
        row = self.rows[path]
        total = row.self_ms
        for ch in self.called_children(path):
            if ch.qualname in self.composite:
                if ch.qualname not in guard and self.fate(self.classes[ch.qualname], guard)[0] == "descend":
                    total += self.loose_ms(ch.path, guard | {ch.qualname})
            elif self.shadowed(ch.qualname, guard):
                total += ch.inclusive_ms
        return total

    def shadowed(self, leaf: str, guard: frozenset) -> bool:
        """A leaf class with an instance inside a composite class taken whole can never be
        chosen next to it: where it is called outside, its time is lost to finer regions."""
        key = (leaf, guard)
        if key not in self._shadowed:  # memoised: large models call this per instance
            self._shadowed[key] = any(
                _inside(p, a) for q in self.composite if q != leaf and q not in guard
                and self.fate(self.classes[q], guard)[0] == "whole"
                for a in self.classes[q].paths for p in self.classes[leaf].paths)
        return self._shadowed[key]

    def fate(self, c: ClassRow, guard: frozenset = frozenset()) -> tuple[str, str]:
        """("whole" | "descend", why) for class c."""
        if c.qualname in self._fate:
            return self._fate[c.qualname]
        guard = guard | {c.qualname}
        incl = sum(self.rows[p].inclusive_ms for p in c.paths) or 1e-12
        own = sum(self.rows[p].self_ms for p in c.paths)
        parts = self.parts(c)
        kids = [self.called_children(p) for p in c.paths]
        if parts:
            loose = sum(self.loose_ms(p, guard) for p in c.paths) / incl
            if loose < OWN_SHARE:
                fate = ("descend", f"its parts ({', '.join(parts[:4])}) are regions of their own; "
                                   f"{loose:.0%} of its time (own ops between them) stays outside")
            else:
                fate = ("whole", f"{loose:.0%} of its time is outside any finer region")
        elif all(len(k) == 1 for k in kids) and all(self.own_ops(p) < 0.5 for p in c.paths):
            fate = ("descend", f"it only wraps {kids[0][0].class_name} (no ops of its own)")
        elif not any(kids):
            fate = ("whole", "no submodules: the whole forward is one region")
        else:
            fate = ("whole", f"a fusion unit: {own / incl:.0%} own ops around leaf modules")
        self._fate[c.qualname] = fate
        return fate


def plan_regions(result: ProfileResult, coverage: float = 0.9, max_regions: int = 8,
                 exclude: tuple[str, ...] = (), min_share: float = 0.05) -> list[RegionVerdict]:
    """Every class of the profile with whether it is chosen and why, heaviest first."""
    tree = _Tree(result, min_share, exclude)
    verdicts: dict[str, RegionVerdict] = {}

    def verdict(c: ClassRow, chosen: bool, reason: str) -> None:
        verdicts[c.qualname] = RegionVerdict(class_name=c.class_name, qualname=c.qualname, share=c.share,
                                             chosen=chosen, reason=reason)

    def builtin(c: ClassRow) -> bool:
        return c.qualname.startswith("torch.")

    def inside_a_unit(c: ClassRow) -> bool:  # a leaf living inside fusion units (Conv1D in GPT-2)
        return c.qualname not in tree.composite and tree.shadowed(c.qualname, frozenset())

    chosen: list[ClassRow] = []
    covered = 0.0
    for c in sorted(result.by_class, key=lambda c: (builtin(c), inside_a_unit(c), -c.inclusive_ms)):
        if c.container:
            verdict(c, False, "a container (ModuleList, Sequential, ...): its members are the regions")
        elif c.inclusive_ms <= 0:
            verdict(c, False, "no time measured in it")
        elif c.share < MIN_REGION_SHARE:
            verdict(c, False, f"too small to tune ({c.share:.1%} of the time)")
        elif c.class_name in exclude or c.qualname in exclude:
            verdict(c, False, "excluded by name")
        elif c.qualname.startswith("torch._dynamo."):  # OptimizedModule: the model compiles it itself
            verdict(c, False, "the model already runs it under torch.compile (a compiled module is not rebuilt "
                              "or routed on its own)")
        elif (fate := tree.fate(c))[0] == "descend":
            verdict(c, False, fate[1])
        elif clash := next((s for s in chosen if any(_inside(p, q) or _inside(q, p) or p == q
                                                     for p in c.paths for q in s.paths)), None):
            verdict(c, False, f"overlaps {clash.class_name}, already chosen (a class's winner replaces "
                              "its forward in every instance)")
        elif covered >= coverage:
            verdict(c, False, f"coverage reached: the chosen regions cover {covered:.0%} (target {coverage:.0%})")
        elif len(chosen) >= max_regions:
            verdict(c, False, f"max_regions ({max_regions}) reached")
        else:
            chosen.append(c)
            covered += c.share
            verdict(c, True, fate[1] + ("" if c.paths != [ROOT] else " (the model itself)"))
    return sorted(verdicts.values(), key=lambda v: -v.share)


def select_regions(result: ProfileResult, coverage: float = 0.9, max_regions: int = 8,
                   exclude: tuple[str, ...] = (), min_share: float = 0.05) -> list[ClassRow]:
    """The chosen classes of `plan_regions`, heaviest first: their shares add up to the coverage."""
    by_q = {c.qualname: c for c in result.by_class}
    return [by_q[v.qualname] for v in plan_regions(result, coverage, max_regions, exclude, min_share)
            if v.chosen]


def not_frozen(result: ProfileResult, frozen: set[str], failed: dict[str, str], model_classes: dict[str, str], *,
               coverage: float = 0.9, max_regions: int = 8, exclude: tuple[str, ...] = (),
               asked: list[str] | None = None) -> dict[str, str]:
    """{class: why it is not a problem} for every class the user's code defines (every class of the
    profile when nothing was frozen): a freeze that failed (`failed`), selection's reason, not in
    the user's `asked` list, or never called. `model_classes`: class name -> qualified name."""
    out = dict(failed)
    for v in plan_regions(result, coverage, max_regions, exclude):
        builtin = v.qualname.startswith("torch.")
        if v.class_name in frozen or v.class_name in out or (frozen and builtin):
            continue
        if asked:
            out[v.class_name] = f"not in --regions ({', '.join(asked)})"
        else:
            can = not builtin and v.share > 0 and not v.reason.startswith(("a container", "the model already runs"))
            hint = f"; --regions {v.class_name} freezes it instead" if can else ""
            out[v.class_name] = f"not chosen: {v.reason}{hint}"
    for name, qualname in model_classes.items():
        if name not in out and name not in frozen and not qualname.startswith("torch."):
            out[name] = "not called by the model's forward on its workloads: no time to win"
    return out
