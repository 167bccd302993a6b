"""The search strategy that the template and compiler planners share: a steady-state genetic
algorithm over finite parameter grids, whose fitness is what the trials measured.

A planner has one or more *arms* (a template under one binding; the compiler's option flags),
each with a `Space`: parameter -> the values to search, the first the default. Given every
point measured so far and its fitness (the speedup a kept candidate reached; failures have
none and are never parents), `evolve` proposes up to n points not seen before:

- the best `parents` points are the parents; one is picked by rank (the best most often);
- with probability `crossover` it is crossed with another parent of the same arm (each
  parameter from one of the two);
- the child is mutated: one or two parameters move to a neighbouring value (most gains are
  local) or, less often, to any value;
- with probability `explore`, and whenever nothing has a fitness yet, a random point of a
  random arm instead;
- when these keep landing on points already seen, the rest of the spaces is walked, best arm
  first, so an empty answer means that every point of every space has been seen.

Everything is drawn from the `random.Random` the caller passes in, so a seeded planner proposes
the same points from the same history.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

Point = dict
Arm = Hashable


def _always(params: dict) -> bool:
    return True


@dataclass(frozen=True)
class Space:
    axes: tuple[tuple[str, tuple], ...]
    """(parameter, values) pairs; the first value of each is the default."""
    fits: Callable[[dict], bool] = _always
    """Whether a point is worth trying (shared memory, registers)."""

    @classmethod
    def of(cls, axes: Mapping[str, Sequence], fits: Callable[[dict], bool] = _always) -> "Space":
        empty = [k for k, v in axes.items() if not len(v)]
        if empty:
            raise ValueError(f"search space: parameter{'s' * (len(empty) > 1)} {', '.join(empty)} "
                             "without any value to try")
        return cls(tuple((k, tuple(v)) for k, v in axes.items()), fits)

    @property
    def names(self) -> list[str]:
        return [k for k, _ in self.axes]

    def default(self) -> Point:
        return {k: v[0] for k, v in self.axes}

    def key(self, params: Mapping) -> tuple:
        """The point as a hashable value (parameters the space does not know are ignored)."""
        return tuple(params.get(k) for k, _ in self.axes)

    def contains(self, params: Mapping) -> bool:
        return set(params) == set(self.names) and all(params[k] in v for k, v in self.axes) and self.fits(dict(params))

    def points(self) -> Iterator[Point]:
        """Every point that fits, defaults first along each parameter."""
        for values in itertools.product(*(v for _, v in self.axes)):
            p = dict(zip(self.names, values))
            if self.fits(p):
                yield p

    def size(self) -> int:
        return _size(self)

    def sample(self, rng: random.Random) -> Point:
        """A random point that fits (the default if none is found quickly)."""
        for _ in range(100):
            p = {k: rng.choice(v) for k, v in self.axes}
            if self.fits(p):
                return p
        return self.default()

    def mutate(self, params: Mapping, rng: random.Random) -> Point:
        out = {k: params.get(k, v[0]) for k, v in self.axes}
        movable = [(k, v) for k, v in self.axes if len(v) > 1]
        for k, raw in rng.sample(movable, min(len(movable), rng.choice((1, 1, 2)))):
            values = sorted(raw) if all(isinstance(x, (int, float)) for x in raw) else list(raw)
            i = values.index(out[k]) if out[k] in values else 0
            if rng.random() < 0.7:  # a neighbouring value: most gains are local
                i = max(0, min(len(values) - 1, i + rng.choice((-1, 1))))
            else:
                i = rng.randrange(len(values))
            out[k] = values[i]
        return out

    def cross(self, a: Mapping, b: Mapping, rng: random.Random) -> Point:
        return {k: rng.choice([a.get(k, v[0]), b.get(k, v[0])]) for k, v in self.axes}


@lru_cache(maxsize=256)
def _size(space: Space) -> int:
    return sum(1 for _ in space.points())


@dataclass(frozen=True)
class Measured:
    arm: Arm
    params: dict
    fitness: float
    """What the trials measured (a kept candidate's speedup); 0 for a failure."""
    ref: str = ""
    """The measured candidate (its hash), named as the parent of children bred from it."""


@dataclass(frozen=True)
class Child:
    arm: Arm
    params: dict
    parents: tuple[str, ...] = ()


def evolve(spaces: Mapping[Arm, Space], measured: Sequence[Measured], is_new: Callable[[Arm, Point], bool],
           n: int, rng: random.Random, parents: int = 4, crossover: float = 0.3,
           explore: float = 0.2) -> list[Child]:
    """Up to n new points that `is_new` accepts, none twice; see the module docstring."""
    out: dict[tuple[Arm, tuple], Child] = {}

    def offer(arm: Arm, params: Point, parents: tuple[str, ...] = ()) -> None:
        key = (arm, spaces[arm].key(params))
        if key not in out and spaces[arm].contains(params) and is_new(arm, params):
            out[key] = Child(arm, params, tuple(p for p in parents if p))

    pool = sorted((m for m in measured if m.fitness > 0 and m.arm in spaces), key=lambda m: -m.fitness)[:parents]
    arms = list(spaces)
    for _ in range(20 * n):
        if len(out) >= n or not arms:
            break
        if pool and rng.random() >= explore:
            a = rng.choices(pool, weights=[1.0 / (i + 1) for i in range(len(pool))])[0]
            child = dict(a.params)
            mates = [m for m in pool if m.arm == a.arm and m is not a]
            lineage = (a.ref,)
            if mates and rng.random() < crossover:
                mate = rng.choice(mates)
                child, lineage = spaces[a.arm].cross(child, mate.params, rng), (a.ref, mate.ref)
            offer(a.arm, spaces[a.arm].mutate(child, rng), lineage)
        else:
            arm = rng.choice(arms)
            offer(arm, spaces[arm].sample(rng))
    if len(out) < n:  # the draws keep hitting seen points: walk what is left, best arm first
        best = {m.arm: i for i, m in reversed(list(enumerate(pool)))}
        for arm in sorted(arms, key=lambda a: best.get(a, len(pool))):
            for params in spaces[arm].points():
                if len(out) >= n:
                    break
                offer(arm, params)
    return list(out.values())[:n]


def seen_points(space: Space, points: Sequence[Mapping]) -> int:
    """How many distinct points of `space` are among `points`."""
    return len({space.key(p) for p in points if space.contains(p)})
