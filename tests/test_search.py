"""The search without rounds and without running dry, on fake lanes: trials that take as long
and measure as much as each test says, so scheduling and stop rules are seen in seconds.

`FakeLanes` is the executor protocol of `agent.search.loop` with threads that sleep instead of
running candidates; the loop, the feed, the budget, the store and the planners are the real
ones. The genetic search is checked on its own against a synthetic fitness.
"""

from __future__ import annotations

import itertools
import queue
import random
import threading
import time
from pathlib import Path

import pytest

from agent.search.budget import Budget
from agent.search.feed import results_of
from agent.history import History
from agent.search.loop import tune
from agent.planners.compiler import CompilerPlanner
from agent.planners.genetic import Measured, Space, evolve
from tools.problem import Problem, StopRule
from tools.runfolder import RunFolder
from tools.trial import Candidate, Status, Trial

ROOT = Path(__file__).resolve().parent.parent
REGION = "Region"


class FakeLanes:
    """`lanes` lanes of one generation; a trial takes `seconds(candidate)` and measures
    `outcome(candidate)` -> (status, speedup)."""

    generations = ["cpu"]

    def __init__(self, lanes: int, seconds=lambda c: 0.0, outcome=lambda c: (Status.ok, 1.0)):
        self.runners = list(range(lanes))
        self.seconds, self.outcome = seconds, outcome
        self.log: list[tuple[str, float, float]] = []  # (candidate, started, finished)
        self.tokens = itertools.count()

    def run(self, feed, budget, should_stop, on_start, screen=lambda region, generation: None):
        results: queue.Queue = queue.Queue()

        def lane(i: int) -> None:
            try:
                while not should_stop() and not budget.exhausted and not feed.drained("cpu"):
                    job = feed.take("cpu", timeout=0.05)
                    if job is None:
                        continue
                    cand, gen, path = job
                    token = next(self.tokens)
                    while not budget.try_launch(token, f"lane{i}"):  # as the local executor does
                        if budget.exhausted or should_stop():
                            return
                        budget.wait(0.02)
                    on_start(cand, gen)
                    start = time.time()
                    time.sleep(self.seconds(cand))
                    status, speedup = self.outcome(cand)
                    trial = Trial(region=cand.region, candidate_hash=cand.hash, status=status, generation=gen,
                                  planner=cand.planner, template=cand.template, params=cand.params,
                                  device=f"lane{i}", candidate_path=path, speedup=speedup if status is Status.ok else None,
                                  ranked=status is Status.ok, gpu_seconds=time.time() - start,
                                  started_at=start, finished_at=time.time())
                    self.log.append((cand.note or cand.hash, start, time.time()))
                    budget.finish(token, trial)
                    results.put(trial)
            finally:
                results.put(None)

        for i in self.runners:
            threading.Thread(target=lane, args=(i,), daemon=True).start()
        yield from results_of(results, len(self.runners))


def fake_problem(name: str = REGION) -> Problem:
    return Problem.model_construct(name=name, target_generations=[], region_class="Fake", device="cpu")


class Numbered:
    """Proposes `count` numbered candidates (or forever), and records what it saw each time asked."""

    name = "numbered"

    def __init__(self, count: int | None = None, note=lambda i: f"c{i}"):
        self.count, self.note, self.next = count, note, 0
        self.asked: list[int] = []

    def propose(self, problem, history, n):
        self.asked.append(len(history.trials))
        out = []
        while len(out) < n and (self.count is None or self.next < self.count):
            out.append(Candidate(region=problem.name, source=f"# {self.next}\n", planner=self.name,
                                 note=self.note(self.next)))
            self.next += 1
        return out


def run_fake(tmp_path, planner, executor, rule: StopRule, problems=None, history=None):
    run = RunFolder(tmp_path / "run")
    run.path.mkdir(parents=True, exist_ok=True)
    problems = problems or [fake_problem()]
    history = history or History({p.name: ["cpu"] for p in problems})
    budget = Budget(rule)
    outcome = tune(run, problems, planner, executor, budget, history)
    return outcome, budget, history


# -- no barrier ------------------------------------------------------------------------------
def test_a_slow_trial_holds_up_only_its_own_lane(tmp_path):
    lanes = FakeLanes(3, seconds=lambda c: 4.0 if c.note == "slow" else 0.05)
    planner = Numbered(40, note=lambda i: "slow" if i == 0 else f"fast{i}")
    outcome, _, _ = run_fake(tmp_path, planner, lanes, StopRule(max_candidates=1000, patience=1000))
    assert outcome.trials_run == 40 and outcome.stop_reason == "planners have nothing new to try"
    (slow,) = [(s, e) for note, s, e in lanes.log if note == "slow"]
    during = [note for note, s, e in lanes.log if note != "slow" and e <= slow[1]]
    # With rounds of 2 x 3 lanes, at most five fast trials could finish while the slow one runs;
    # without, the other two lanes do nearly all 39 (about 1 s of work) in its 4 s.
    assert len(during) >= 30, f"the other lanes waited for the slow trial: {len(during)} finished meanwhile"
    # The planner was asked again and again while the slow trial ran, each time with new results.
    assert len(planner.asked) >= 5 and planner.asked == sorted(set(planner.asked))


# -- stop reasons ----------------------------------------------------------------------------
def test_a_real_space_is_tried_to_the_end_and_its_size_is_the_stop_reason(tmp_path):
    planner = CompilerPlanner(device="cpu")
    bits = lambda c: len(c.params.get("options", {}))  # noqa: E731 - a synthetic fitness
    lanes = FakeLanes(4, outcome=lambda c: (Status.ok, 1.0 + 0.1 * bits(c)))
    size = planner.space_size(fake_problem())
    assert size == 2 + 2 ** 10 - 1
    outcome, _, history = run_fake(tmp_path, planner, lanes, StopRule(max_candidates=5000, patience=5000))
    assert outcome.stop_reason == f"search space exhausted: {size} of {size} candidates tried"
    assert outcome.trials_run == size == len(history.records)  # every point once, none twice
    assert outcome.best[REGION] == pytest.approx(2.0)  # all ten options on


def test_patience_and_the_candidate_cap_stop_a_search_that_has_more_to_try(tmp_path):
    # Trials of 0.2 s: with instant ones, two lanes outran the loop counting their results on a
    # loaded CI machine (12 trials before patience stopped them, once).
    same = FakeLanes(2, seconds=lambda c: 0.2, outcome=lambda c: (Status.ok, 1.0))
    outcome, budget, _ = run_fake(tmp_path / "a", CompilerPlanner(device="cpu"), same,
                                  StopRule(max_candidates=5000, patience=6))
    assert outcome.stop_reason.startswith("patience") and 6 <= outcome.trials_run <= 6 + 2 * 2
    better = FakeLanes(2, outcome=lambda c: (Status.ok, 1.0 + len(c.params.get("options", {}))))
    outcome, budget, _ = run_fake(tmp_path / "b", CompilerPlanner(device="cpu"), better,
                                  StopRule(max_candidates=30, patience=5000))
    assert outcome.stop_reason == "candidate cap: 30 candidates tried" and outcome.trials_run == 30


def test_planners_without_a_known_space_stop_as_having_nothing_new(tmp_path):
    outcome, _, _ = run_fake(tmp_path, Numbered(5), FakeLanes(2), StopRule(max_candidates=100, patience=100))
    assert outcome.stop_reason == "planners have nothing new to try" and outcome.trials_run == 5


# -- the template planner widens while it trails -----------------------------------------------
@pytest.fixture(scope="module")
def tiny_problem(tmp_path_factory) -> Problem:
    from agent.setup.jobs import profile_and_freeze
    res = profile_and_freeze(ROOT / "tests" / "models" / "tiny_rmsnorm.py", "cpu", None,
                             tmp_path_factory.mktemp("tiny"))
    return res.problems[0]


def _with_baseline(speedup: float) -> History:
    """A history where torch.compile reached `speedup` on the region."""
    history = History({"RMSNorm": ["cpu"]})
    history.add(Trial(region="RMSNorm", candidate_hash="compiled", status=Status.ok, generation="cpu",
                      planner="compiler", template="torch_compile", params={"mode": None, "options": {}},
                      speedup=speedup, ranked=True))
    return history


@pytest.mark.parametrize("template_speedup, widened", [(1.5, True), (3.0, False)])
def test_the_template_space_widens_while_its_best_trails_the_compiler(tmp_path, tiny_problem, template_speedup,
                                                                     widened):
    from agent.planners.library import MAX_WIDEN, TEMPLATES, widen
    from agent.planners.template import TemplatePlanner
    planner = TemplatePlanner()
    # RMSNorm's arm computes the function; LayerNorm's does not, so its arm is not searched.
    lanes = FakeLanes(3, outcome=lambda c: (Status.wrong, None) if c.template == "layernorm"
                      else (Status.ok, template_speedup))
    outcome, _, history = run_fake(tmp_path, planner, lanes, StopRule(max_candidates=5000, patience=5000),
                                   problems=[tiny_problem], history=_with_baseline(2.0))
    tried, size = planner.coverage(tiny_problem, history)
    assert outcome.stop_reason == f"search space exhausted: {size} of {size} candidates tried"
    assert outcome.trials_run == len(history.records) - 1  # every candidate once (and the baseline)
    rmsnorm = TEMPLATES["rmsnorm"]
    searched = Space.of(widen(rmsnorm.space, MAX_WIDEN if widened else 0), rmsnorm.fits).size()
    layernorm = [r for r in history.records.values() if r.template == "layernorm"]
    assert tried == size == searched + len(layernorm)
    assert searched > Space.of(rmsnorm.space, rmsnorm.fits).size() if widened else searched == 20
    tiles = {r.params["tune"]["BLOCK_N"] for r in history.records.values() if r.template == "rmsnorm"}
    assert (8192 in tiles) is widened  # larger tiles than the template's own range, only while it trails


# -- the genetic search ----------------------------------------------------------------------
SPACE = Space.of({f"p{i}": tuple(range(8)) for i in range(5)})  # 32768 points
PEAK = {"p0": 5, "p1": 2, "p2": 7, "p3": 3, "p4": 6}


def fitness(p: dict) -> float:
    return 1.0 + sum(7 - abs(p[k] - v) for k, v in PEAK.items())


def _search(seed: int, rounds: int = 25, n: int = 8, strategy: str = "ga") -> tuple[list[dict], float]:
    rng, seen, measured = random.Random(seed), set(), []
    for _ in range(rounds):
        if strategy == "ga":
            children = [c.params for c in evolve({"a": SPACE}, measured, lambda a, p: SPACE.key(p) not in seen,
                                                 n, rng)]
        else:
            children = [SPACE.sample(rng) for _ in range(n)]
        for p in children:
            if strategy == "ga":
                assert SPACE.key(p) not in seen, "proposed a point already measured"
            seen.add(SPACE.key(p))
            measured.append(Measured("a", p, fitness(p)))
    return [m.params for m in measured], max(m.fitness for m in measured)


def test_the_genetic_search_proposes_only_unseen_points_and_climbs_a_synthetic_fitness():
    points, best = _search(seed=1)
    assert len({SPACE.key(p) for p in points}) == len(points) == 200
    first = max(fitness(p) for p in points[:8])
    _, random_best = _search(seed=1, strategy="random")
    assert best > first and best > random_best and best >= fitness(PEAK) - 2  # near the peak
    assert _search(seed=1)[0] == points  # seeded: the same history gives the same proposals


def test_the_genetic_search_walks_the_rest_of_a_space_before_saying_it_is_empty():
    space = Space.of({"a": (1, 2, 3), "b": (True, False)}, fits=lambda p: not (p["a"] == 3 and p["b"]))
    rng, seen, measured = random.Random(0), set(), []
    while batch := evolve({"x": space}, measured, lambda a, p: space.key(p) not in seen, 2, rng):
        for c in batch:
            seen.add(space.key(c.params))
            measured.append(Measured("x", c.params, 1.0 + c.params["a"]))
    assert len(seen) == space.size() == 5


def test_a_space_with_a_parameter_of_no_values_is_refused_by_name():
    with pytest.raises(ValueError, match="BLOCK_N without any value"):
        Space.of({"BLOCK_N": (), "num_warps": (4,)})


# -- the default planner: templates, then the compiler ------------------------------------------
@pytest.mark.parametrize("model, first", [("conv_relu.py", "compiler"), ("tiny_rmsnorm.py", "template")])
def test_auto_searches_a_region_no_template_fits_and_goes_on_when_templates_run_dry(tmp_path, model, first):
    """`auto` (the default): a convolution gets torch.compile's candidates, where the template
    planner alone has none (0 of 0); an RMSNorm gets its templates first, and the compiler's
    candidates whenever the templates have nothing new; the run ends only when both spaces are
    spent, and says their size."""
    from agent.setup.jobs import profile_and_freeze
    from agent.planners import make_planner
    res = profile_and_freeze(ROOT / "tests" / "models" / model, "cpu", None, tmp_path / "runs")
    problems = res.problems[:1]
    history = History({p.name: ["cpu"] for p in problems})
    planner = make_planner("auto", device="cpu")
    lanes = FakeLanes(2)
    outcome, _, history = run_fake(tmp_path, planner, lanes, StopRule(max_candidates=100000, patience=100000),
                                   problems, history)
    sizes = [p.coverage(problems[0], History()) for p in planner.planners]
    total = sum(s for _, s in sizes)
    assert (sizes[0][1] == 0) == (first == "compiler") and sizes[1][1] > 0
    assert outcome.stop_reason == f"search space exhausted: {total} of {total} candidates tried"
    by_planner = [t.planner for t in sorted(history.trials, key=lambda t: t.started_at)]
    assert by_planner[0] == first and by_planner.count("compiler") == sizes[1][1]
    # (after the first, the two interleave: whenever every template point is in flight or
    # waiting on results, a lane takes a compile candidate rather than idle)


def test_auto_and_one_of_its_own_planners_together_is_a_clear_error():
    from agent.planners import PlannerError, make_planner
    with pytest.raises(PlannerError, match="auto is template then compiler already"):
        make_planner("auto,template", device="cpu")
    assert make_planner("auto,files", device="cpu", inbox=Path("/nonexistent")).name == "auto,files"


class Batch:
    """Proposes six candidates a region at once, more than it was asked for (as the template
    planner's first batch is)."""

    name = "batch"

    def propose(self, problem, history, n):
        made = [Candidate(region=problem.name, source=f"# {problem.name} {i}\n", planner=self.name,
                          note=f"{problem.name} {i}") for i in range(6)]
        return [c for c in made if not history.tried(problem.name, c.hash)]


def test_a_short_night_tries_every_region_first(tmp_path):
    """Queued region by region, the H200's LlamaModel tune spent its 5 trials on attention alone:
    every region's first candidate now goes before any region's second."""
    lanes = FakeLanes(1)
    problems = [fake_problem(n) for n in ("Attention", "MLP", "Norm")]
    outcome, _, _ = run_fake(tmp_path, Batch(), lanes, StopRule(max_candidates=3, patience=1000), problems)
    assert outcome.trials_run == 3
    assert sorted(note.split()[0] for note, _, _ in lanes.log) == ["Attention", "MLP", "Norm"], lanes.log


# -- bindings that only swap tensors between roles ---------------------------------------------
@pytest.mark.parametrize("named_order_right", [True, False])
def test_a_swapped_binding_is_tried_only_once_the_named_one_computed_another_function(tmp_path, frozen_run,
                                                                                       named_order_right):
    """The KV-cache attention templates bind K and V projections of one shape in both orders. The
    order the names give is tried first; the swap only where that one proved wrong (on the H200
    the swap was two of a short tune's five trials, both `wrong`)."""
    from agent.planners.template import TemplatePlanner
    attention = Problem.load(frozen_run / "LlamaAttention")

    def right(c: Candidate) -> bool:
        named = c.params["binding"].get("k_w", "k").startswith("k")
        return named == named_order_right
    lanes = FakeLanes(2, outcome=lambda c: (Status.ok, 1.1) if right(c) else (Status.wrong, None))
    outcome, _, history = run_fake(tmp_path, TemplatePlanner(), lanes, StopRule(max_candidates=60, patience=5000),
                                   problems=[attention])
    kv = [r for r in history.records.values() if "k_w" in r.params.get("binding", {})]
    assert kv, "no KV-cache attention template applies to the example's attention"
    swapped = [r for r in kv if not r.params["binding"]["k_w"].startswith("k")]
    if named_order_right:
        assert not swapped, [r.template for r in swapped]
    else:  # the named order is wrong for each template: its swap is tried, and then searched
        assert {r.template for r in swapped} == {r.template for r in kv}
        assert all(r.params["binding"]["k_w"].startswith("k") for r in kv if r.failed() is not None)


# -- the finalists, timed again -----------------------------------------------------------------
def test_a_regions_best_wins_are_timed_again_when_the_search_ends_and_replace_their_trials(tmp_path):
    """Issue 49 (Inductor's max-autotune re-times its top few): the best RETIME_TOP wins of a region
    run once more, after the search, and those trials are the ones ranked."""
    from agent.search.loop import RETIME_TOP
    speed = {f"# {i}\n": 1.0 + i / 10 for i in range(6)}  # the first is no win: 1.0x
    lanes = FakeLanes(2, outcome=lambda c: (Status.ok, speed[c.source]))
    run = RunFolder(tmp_path / "run")
    run.path.mkdir(parents=True)
    history, budget = History({REGION: ["cpu"]}), Budget(StopRule(max_candidates=100, patience=100))
    outcome = tune(run, [fake_problem()], Numbered(6), lanes, budget, history, retime=True)
    assert outcome.trials_run == 6 + RETIME_TOP
    again = [digest for digest, _, _ in lanes.log[6:]]  # a finalist is its stored self: no note
    assert sorted(again) == sorted(Candidate(region=REGION, source=f"# {i}\n").hash for i in (3, 4, 5))
    best = history.best(REGION).by_generation["cpu"]
    assert best.speedup == 1.5 and any("timed again" in f or "re-timed" in f for f in best.flags)
    assert budget.held == 0.0


def test_the_budget_holds_back_room_for_the_finalists_until_the_search_ends():
    budget = Budget(StopRule(gpu_hours=100 / 3600), spent_seconds=61.0)
    budget.remember([Trial(region="R", candidate_hash="a", status=Status.ok, gpu_seconds=10.0)])
    assert budget.try_launch(1, region="R")  # 61 + 10 of 100
    budget.cancel(1)
    budget.hold({"R": 3})  # three finalists of about 10 s each
    assert not budget.try_launch(2, region="R") and budget.exhausted  # 30 + 61 + 10 > 100
    budget.release_held()
    assert not budget.exhausted and budget.try_launch(3, region="R")
