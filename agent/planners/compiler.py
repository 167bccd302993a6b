"""The compiler planner: torch.compile (TorchInductor) of the region as candidates.

Every region, whatever its code, gets these, so the search at worst matches the compiler and a
template or LLM kernel has to beat it to win. The space is Inductor's own code-generation
choices: a mode (default, max-autotune without CUDA graphs, reduce-overhead where the device
has CUDA graphs) and a set of options that change the generated code (autotuning of GEMMs and
pointwise kernels, coordinate-descent tuning of launch configurations, epilogue and aggressive
fusion, persistent and split reductions, N-d tiling, block pointers, combo kernels). The first
proposals are the modes and each option alone; after that a small genetic search over the
option flags: the best kept points are parents, children flip one or two flags or take each
flag from one of two parents. Everything is judged like any other candidate: verified against
the frozen reference, timed against the original.
"""

from __future__ import annotations

import itertools
import json
import random

from agent.history import History
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


class CompilerPlanner:
    name = "compiler"

    def __init__(self, seed: int = 0, parents: int = 4, device: str = "", **_):
        self.seed, self.parents = seed, parents
        # reduce-overhead captures CUDA graphs: only where the run's devices are GPUs.
        self.modes = MODES if "sm" in device or "gfx" in device or "cuda" in device else MODES[:2]

    def space_size(self, problem: Problem) -> int:
        return len(self.modes) + (2 ** len(FLAGS) - 1)

    def candidate(self, problem: Problem, mode: str | None, options: dict, parents: list[str] = ()) -> Candidate:
        return Candidate(region=problem.name, planner=self.name, template="torch_compile",
                         source=render_code("kernels/torch_compile.py.j2", mode=mode, options=options),
                         params={"mode": mode, "options": options}, parents=list(parents))

    def propose(self, problem: Problem, history: History, n: int) -> list[Candidate]:
        rng = random.Random(f"{self.seed}/{problem.name}/{len(history.trials)}")
        out: dict[str, Candidate] = {}

        def offer(mode, options, parents=()):
            c = self.candidate(problem, mode, options, parents)
            if c.hash not in out and not history.tried(problem.name, c.hash):
                out[c.hash] = c

        zero = (0,) * len(FLAGS)
        for mode in self.modes:  # the modes first: what a user of torch.compile would try
            offer(*_point(mode, zero))
        for i in range(len(FLAGS)):  # then each option alone
            offer(*_point(None, tuple(int(j == i) for j in range(len(FLAGS)))))
        mine = [r for r in history.kept(problem.name) if r.planner == self.name and "options" in r.params]
        parents = [self._bits(r.params["options"]) for r in mine[: self.parents]]
        for _ in range(40 * n):
            if len(out) >= n + len(self.modes) + len(FLAGS):
                break
            if parents:
                a = rng.choices(parents, weights=[1 / (k + 1) for k in range(len(parents))])[0]
                child = list(a)
                if len(parents) > 1 and rng.random() < 0.3:
                    b = rng.choice(parents)
                    child = [rng.choice(pair) for pair in zip(a, b)]
                for k in rng.sample(range(len(FLAGS)), rng.choice((1, 1, 2))):
                    child[k] ^= 1
                offer(*_point(None, tuple(child)), [r.candidate_hash for r in mine[:1]])
            else:
                offer(*_point(None, tuple(rng.randint(0, 1) for _ in FLAGS)))
        fresh = [c for c in out.values() if not history.tried(problem.name, c.hash)]
        return fresh[:n]

    @staticmethod
    def _bits(options: dict) -> tuple[int, ...]:
        return tuple(int(name in options) for name, _ in FLAGS)


def all_points() -> list[tuple[str | None, dict]]:
    """Every point of the option space (for tests and the space's size)."""
    return [_point(None, bits) for bits in itertools.product((0, 1), repeat=len(FLAGS))]


def describe(params: dict) -> str:
    return f"torch.compile mode={params.get('mode')!r} options={json.dumps(params.get('options', {}))}"
