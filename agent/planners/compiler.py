"""The compiler planner: torch.compile (TorchInductor) of the region as candidates.

Every region, whatever its code, gets these, so the search at worst matches the compiler and a
template or LLM kernel has to beat it to win. The space is Inductor's own code-generation
choices: a mode (default, max-autotune without CUDA graphs, reduce-overhead where the device
has CUDA graphs) and a set of options that change the generated code (autotuning of GEMMs and
pointwise kernels, coordinate-descent tuning of launch configurations, epilogue and aggressive
fusion, persistent and split reductions, N-d tiling, block pointers, combo kernels). The first
proposals are the modes and each option alone; after that the shared genetic search
(`agent.planners.genetic`) over the option flags, whose fitness is the speedups measured: the
best kept points are parents, children take each flag from one of two parents and flip one or
two; once draws stop finding new points the rest of the flags' space is walked. Everything is judged like any other candidate: verified against
the frozen reference, timed against the original.
"""

from __future__ import annotations

import json
import random

from agent.history import History
from agent.planners.genetic import Measured, Space, evolve
from agent.prompting import render_code
from tools.problem import Problem
from tools.trial import Candidate

FLAGS: tuple[tuple[str, object], ...] = (
    ("max_autotune", True),
    ("coordinate_descent_tuning", True),
    ("epilogue_fusion", False),
    ("aggressive_fusion", True),
    ("triton.persistent_reductions", False),
    ("split_reductions", False),
    ("triton.prefer_nd_tiling", True),
    ("triton.use_block_ptr", True),
    ("combo_kernels", True),
    ("shape_padding", False),
)
"""Options that change Inductor's generated code, each with the value that is not its default."""
MODES: tuple[str | None, ...] = (None, "max-autotune-no-cudagraphs", "reduce-overhead")


def _point(mode: str | None, bits: tuple[int, ...]) -> tuple[str | None, dict]:
    return mode, {name: value for (name, value), on in zip(FLAGS, bits) if on}


FLAG_SPACE = Space.of({name: (0, 1) for name, _ in FLAGS})
"""Each option off (its default) or on (the value in `FLAGS`)."""


class CompilerPlanner:
    name = "compiler"

    def __init__(self, seed: int = 0, parents: int = 4, device: str = "", **_):
        self.seed, self.parents = seed, parents
        # reduce-overhead captures CUDA graphs: only where the run's devices are GPUs.
        self.modes = MODES if "sm" in device or "gfx" in device or "cuda" in device else MODES[:2]

    def space_size(self, problem: Problem, history: History | None = None) -> int:
        return len(self.modes) + FLAG_SPACE.size() - 1  # mode None without options is the first mode

    def coverage(self, problem: Problem, history: History) -> tuple[int, int]:
        """(points of the space tried on every target generation, the space's size)."""
        gens = history.targets(problem.name)
        tried = {(r.params.get("mode"), self._bits(r.params.get("options", {})))
                 for r in history.region_records(problem.name) if r.planner == self.name and "options" in r.params
                 and all(history.done(problem.name, r.candidate_hash, g) for g in gens)}
        return len(tried), self.space_size(problem)

    def candidate(self, problem: Problem, mode: str | None, options: dict, parents: list[str] = ()) -> Candidate:
        # A region drawing random numbers is checked seeded alike: Inductor's generator would fail
        # every check there, so its candidates draw torch's numbers (fallback_random).
        seeded = {"eager_rng": True} if problem.seeded_calls else {}
        return Candidate(region=problem.name, planner=self.name, template="torch_compile",
                         source=render_code("kernels/torch_compile.py.j2", mode=mode, options=options, **seeded),
                         params={"mode": mode, "options": options, **seeded}, parents=list(parents))

    def propose(self, problem: Problem, history: History, n: int) -> list[Candidate]:
        rng = random.Random(f"{self.seed}/{problem.name}/{len(history.trials)}")
        out: dict[str, Candidate] = {}

        def offer(c: Candidate) -> None:
            if len(out) < n and c.hash not in out and not history.tried(problem.name, c.hash):
                out[c.hash] = c

        zero = (0,) * len(FLAGS)
        for mode in self.modes:  # the modes first: what a user of torch.compile would try
            offer(self.candidate(problem, *_point(mode, zero)))
        for i in range(len(FLAGS)):  # then each option alone
            offer(self.candidate(problem, *_point(None, tuple(int(j == i) for j in range(len(FLAGS))))))
        gens = history.targets(problem.name)
        mine = [r for r in history.region_records(problem.name) if r.planner == self.name and "options" in r.params]
        measured = [Measured("flags", self._flags(r.params["options"]), r.score(gens), r.candidate_hash)
                    for r in mine if r.params.get("mode") is None]
        known = {FLAG_SPACE.key(m.params): m.ref for m in measured}
        made: dict[tuple, Candidate] = {}

        def is_new(arm: str, flags: dict) -> bool:
            key = FLAG_SPACE.key(flags)
            if key in known:  # measured already: no need to render it to know
                return not history.tried(problem.name, known[key])
            made[key] = c = self.candidate(problem, *_point(None, key))
            return c.hash not in out and not history.tried(problem.name, c.hash)

        for child in evolve({"flags": FLAG_SPACE}, measured, is_new, n - len(out), rng, self.parents):
            key = FLAG_SPACE.key(child.params)
            c = made.get(key) or self.candidate(problem, *_point(None, key))
            offer(c.model_copy(update={"parents": list(child.parents)}))
        return list(out.values())[:n]

    @staticmethod
    def _bits(options: dict) -> tuple[int, ...]:
        return tuple(int(name in options) for name, _ in FLAGS)

    @classmethod
    def _flags(cls, options: dict) -> dict:
        return dict(zip(FLAG_SPACE.names, cls._bits(options)))


def all_points() -> list[tuple[str | None, dict]]:
    """Every point of the option space (for tests and the space's size)."""
    return [_point(None, FLAG_SPACE.key(p)) for p in FLAG_SPACE.points()]


def describe(params: dict) -> str:
    return f"torch.compile mode={params.get('mode')!r} options={json.dumps(params.get('options', {}))}"
