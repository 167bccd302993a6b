"""Ray executor: the same trials as the local executor, on every GPU of a Ray cluster.

    agent tune --model llama.py --executor ray [--ray-address ray://head:10001]

Without an address a local Ray instance is started (this machine's GPUs, or one CPU worker).
Ray is imported only when this executor is built; `pip install 'nightshift[ray]'`.

Device pools per generation, one resource scheme
-----------------------------------------------
A node serves generation `G` when it carries either

* a custom resource `gen:G` = the number of worker actors it hosts for `G` (one per GPU on a
  GPU node: `ray start --resources '{"gen:H200": 8}'`; on CPU-only nodes, as in the tests'
  simulated clusters, `gen:a: 2` gives two CPU workers labelled `a`), or, when it has no
  `gen:*` resource at all,
* GPUs and Ray's own `accelerator_type:T` resource (Ray sets it from the GPU's name, e.g.
  `accelerator_type:H200`): `G = T`, one worker actor per GPU.

Each worker actor is pinned to its node (node affinity, not soft), asks for `num_gpus=1` on
GPU nodes (so Ray gives it its own `CUDA_VISIBLE_DEVICES`) and for one unit of `gen:G` (or a
sliver, 0.001, of `accelerator_type:T`). Jobs come from the loop's feed (`agent.search.feed.Feed`),
one queue per generation; a job is (candidate, generation), and the loop makes one per target
generation; an actor slot takes the next one the moment it is free, so a candidate that
passes on one generation is run on every other target before the loop can keep it
(`History.kept` needs all of them). A target generation with no actor in the cluster is a
`ClusterError` before the first trial, never a silent skip.

Isolation and verification
--------------------------
Each actor hosts a `sandbox.pool.DevicePool` of `workers_per_device` runners (on a GPU, as many
as the local executor would start for the node's cores; 1 on the CPU), the same pool the local
executor keeps per device: candidate code still runs only in a
sandbox worker subprocess of the actor, with the same isolation. The verdict (tolerance,
poisoned outputs, hashes, fresh inputs) is made by the TrialRunner in the actor process,
which holds the frozen references and runs no candidate code; it is the same code and the
same decision the tuner makes with the local executor, one process boundary further away
(the actor is as trusted as the tuner: both run our code only). The frozen problem folders
(and the model file) travel to the cluster once through Ray's object store (one `ray.put`)
and are written to a temporary folder on each actor's node, not sent per trial. Actors
return trials as JSON; the tuner process stays the only writer of the run's store.

Faults
------
An actor or node lost mid-trial (`RayActorError`, a node death) costs that trial only: it is
returned as `lost` (charged the wall time it held the device), and the loop queues it once more,
for another live actor of the same generation; a second loss is final. Dead actors leave the
pool; the next session (`run` call) tops the pools up again from what the cluster offers. Every trial's
`gpu_seconds` is the device time on its node (a device costs its wall time once however many
sandbox workers share it), so `--gpu-hours` counts GPU time on every node. Resume needs
nothing from the executor: the loop skips every (candidate, generation) in the store, except
trials recorded `lost`, which a resume runs again.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from agent.search.budget import Budget
from agent.search.feed import Feed, Job
from sandbox.runner import Limits
from tools.trial import Candidate, Status, Trial
from agent.executors.ray_cluster import (  # noqa: F401  (PoolSlot: re-exported for callers)
    ACCEL_PREFIX, GEN_PREFIX, ClusterError, PoolSlot, TrialActor, connect, discover, import_ray, pack_problems)


@dataclass
class ActorRef:
    handle: Any
    generation: str
    node_id: str
    slots: int
    label: str = ""
    pid: int = 0
    alive: bool = True
    busy: int = 0


@dataclass
class _Flight:
    job: Job
    actor: ActorRef
    token: int
    sent: float


class RayExecutor:
    """Executor protocol of `agent.search.loop` over a Ray cluster; see the module docstring."""

    def __init__(self, problem_dirs: list[Path], address: str | None = None, targets: list[str] | None = None,
                 limits: Limits | None = None, memory_gb: float = 8.0, workers_per_device: int | None = None,
                 ready_timeout: float = 300.0):
        ray = import_ray()
        self.ray = ray
        self.owns_ray = connect(address)
        try:
            self.limits = limits or Limits()
            self.memory_gb = memory_gb
            self.workers_per_device = workers_per_device
            self.ready_timeout = ready_timeout
            self.start_errors: list[str] = []
            pools = discover(ray.nodes())
            wanted = sorted(set(targets)) if targets else sorted(pools)
            self._check(wanted, pools)
            self.targets = wanted
            self.packed = ray.put(pack_problems(problem_dirs))  # once, for every actor of the cluster
            self.remote_cls = ray.remote(TrialActor)
            self.actors: list[ActorRef] = []
            self.tokens = itertools.count()
            self.stopping = threading.Event()
            self._top_up()
            self._check(wanted, self._live_pools(), started=True)
        except BaseException:
            self.close()
            raise

    # -- pools -------------------------------------------------------------------------------
    def _check(self, wanted: list[str], pools: dict, started: bool = False) -> None:
        missing = [g for g in wanted if not pools.get(g)]
        if not wanted or missing:
            have = ", ".join(sorted(g for g, v in pools.items() if v)) or "none"
            what = "no worker actor could start for" if started else "the Ray cluster has no worker of"
            why = f"; first failure: {self.start_errors[0]}" if started and self.start_errors else ""
            raise ClusterError(
                f"{what} target generation{'s' if len(missing) != 1 else ''} "
                f"{', '.join(missing) or '(none found)'} (cluster generations: {have}); a node serves "
                f"generation G with the custom resource '{GEN_PREFIX}G' or GPUs labelled '{ACCEL_PREFIX}G'{why}")

    def _live_pools(self) -> dict[str, list[ActorRef]]:
        out: dict[str, list[ActorRef]] = {}
        for a in self.actors:
            if a.alive:
                out.setdefault(a.generation, []).append(a)
        return out

    def _top_up(self) -> None:
        """Start actors for every free device of the target generations (first call: all)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        ray = self.ray
        have: dict[tuple[str, str], int] = {}
        for a in self.actors:
            if a.alive:
                have[(a.generation, a.node_id)] = have.get((a.generation, a.node_id), 0) + 1
        new: list[ActorRef] = []
        for g in self.targets:
            for slot in discover(ray.nodes()).get(g, []):
                workers = (self.workers_per_device or slot.workers) if slot.gpu else 1
                for _ in range(slot.count - have.get((g, slot.node_id), 0)):
                    handle = self.remote_cls.options(
                        num_cpus=0, num_gpus=1 if slot.gpu else 0,
                        resources={slot.resource: slot.amount} if slot.amount else {},
                        scheduling_strategy=NodeAffinitySchedulingStrategy(slot.node_id, soft=False),
                        max_concurrency=workers + 2, max_restarts=0, max_task_retries=0,
                    ).remote(g, slot.gpu, workers, self.packed, self.limits, self.memory_gb)
                    new.append(ActorRef(handle, g, slot.node_id, workers))
        if not new:
            return
        refs = {a.handle.ready.remote(): a for a in new}
        done, pending = ray.wait(list(refs), num_returns=len(refs), timeout=self.ready_timeout)
        for ref in done:
            a = refs[ref]
            try:
                info = ray.get(ref)
                a.label, a.pid = info["label"], info["pid"]
                self.actors.append(a)
            except ray.exceptions.RayError as e:
                lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
                self.start_errors.append(f"{a.generation}: {lines[-1] if lines else type(e).__name__}")
                ray.kill(a.handle, no_restart=True)
        for ref in pending:  # could not be placed in time: do not count on it
            self.start_errors.append(f"{refs[ref].generation}: not placed within {self.ready_timeout:g} s")
            ray.kill(refs[ref].handle, no_restart=True)

    @property
    def generations(self) -> list[str]:
        return list(self.targets)

    def describe(self) -> str:
        """One line: the pools, e.g. `Ray: H200 8 devices on 1 node, H100 16 devices on 2 nodes`."""
        parts = []
        for g, actors in sorted(self._live_pools().items()):
            nodes = len({a.node_id for a in actors})
            parts.append(f"{g} {len(actors)} device{'s' * (len(actors) != 1)} on {nodes} node{'s' * (nodes != 1)}")
        return "Ray: " + ", ".join(parts)

    @property
    def runners(self) -> list[ActorRef]:
        """One entry per sandbox worker in the cluster (the loop sizes its batches by it)."""
        return [a for a in self.actors if a.alive for _ in range(a.slots)]

    # -- running ---------------------------------------------------------------------------------
    def run(self, feed: Feed, budget: Budget, should_stop: Callable[[], bool] = lambda: False,
            on_start: Callable[[Candidate, str], None] = lambda c, g: None,
            screen: Callable[[str, str], Any] = lambda r, g: None) -> Iterator[Trial | None]:
        """Every worker slot takes the next job of its generation from `feed` as soon as it is
        free; yields trials as they finish, and None while none did (so the caller can refill
        the feed). Ends once the feed is closed and drained, the budget is spent, or `should_stop`."""
        ray = self.ray
        self.stopping.clear()
        self._top_up()  # replace actors lost in an earlier session, where the cluster still has room
        self._check(self.targets, self._live_pools(), started=True)
        flights: dict[Any, _Flight] = {}

        def stopped() -> bool:
            return should_stop() or self.stopping.is_set()

        while True:
            if stopped():  # interrupted: what is in flight is not a result, so resume runs it again
                for fl in flights.values():
                    budget.cancel(fl.token)
                    fl.actor.busy -= 1
                busy = {id(fl.actor): fl.actor for fl in flights.values()}.values()
                asked = [a.handle.interrupt.remote() for a in busy]
                if asked:  # done before the next session can hand these actors new work
                    ray.wait(asked, num_returns=len(asked), timeout=30)
                return
            while not budget.exhausted:
                generation, actor = self._next(feed)
                if generation is None:
                    break
                if actor is None:  # nobody left of that generation: the job is lost, not hung
                    job = feed.take(generation)
                    if job:
                        yield self._lost(job, None, time.time(), "no live worker of generation "
                                         f"{generation} left in the cluster")
                    continue
                token = next(self.tokens)
                if not budget.try_launch(token, actor.label):
                    break  # asked again once a trial in flight ends: it may make room
                job = feed.take(generation)
                if job is None:
                    budget.cancel(token)
                    break
                on_start(job[0], generation)
                actor.busy += 1
                ref = actor.handle.run.remote(job[0].model_dump_json(), job[2], screen(job[0].region, generation))
                flights[ref] = _Flight(job, actor, token, time.time())
            if not flights and (budget.exhausted or feed.drained()):
                return
            if not flights:
                time.sleep(0.1)
                yield None
                continue
            ready, _ = ray.wait(list(flights), num_returns=1, timeout=0.1)
            if not ready:
                yield None
            for ref in ready:
                fl = flights.pop(ref)
                fl.actor.busy -= 1
                try:
                    trial = Trial.model_validate_json(ray.get(ref))
                except ray.exceptions.RayTaskError as e:  # our method raised: a harness bug
                    trial = self._lost(fl.job, fl.actor, fl.sent, f"harness error in the worker actor: {e}")
                except ray.exceptions.RayError as e:  # the actor or its node is gone; the loop runs it again
                    fl.actor.alive = False
                    trial = self._lost(fl.job, fl.actor, fl.sent,
                                       f"worker actor {fl.actor.label} lost mid-trial ({type(e).__name__})")
                if stopped():
                    budget.cancel(fl.token)
                    continue
                budget.finish(fl.token, trial)
                yield trial

    def _next(self, feed: Feed) -> tuple[str | None, ActorRef | None]:
        """A generation with a job waiting that an idle actor can take, and that actor (least
        busy first); a generation with jobs but no live actor at all comes back with None."""
        live = self._live_pools()
        for g in self.targets:
            if not feed.waiting(g):
                continue
            actors = live.get(g, [])
            if not actors:
                return g, None
            idle = [a for a in actors if a.busy < a.slots]
            if idle:
                return g, min(idle, key=lambda a: a.busy)
        return None, None

    def _lost(self, job: Job, actor: ActorRef | None, sent: float, reason: str) -> Trial:
        now = time.time()
        c, generation, path = job
        return Trial(region=c.region, candidate_hash=c.hash, candidate_path=path, planner=c.planner,
                     template=c.template, params=c.params, status=Status.lost, reason=reason,
                     device=actor.label if actor else "", generation=generation,
                     gpu_seconds=max(0.0, now - sent) if actor else 0.0, started_at=sent, finished_at=now)

    def interrupt(self) -> None:
        """Ask a running `run` to stop (safe from a signal handler: it only sets a flag)."""
        self.stopping.set()

    def close(self) -> None:
        ray = getattr(self, "ray", None)
        if ray is None or not ray.is_initialized():
            return
        actors = [a for a in getattr(self, "actors", []) if a.alive]
        if actors:
            try:
                ray.wait([a.handle.close.remote() for a in actors], num_returns=len(actors), timeout=30)
            except Exception:
                pass
        for a in getattr(self, "actors", []):
            try:
                ray.kill(a.handle, no_restart=True)
            except Exception:
                pass
        self.actors = []
        if getattr(self, "owns_ray", False):
            ray.shutdown()
