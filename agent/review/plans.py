"""What integration routes into the whole model per region: its kept candidates worth trying,
best first, each read back from the run's folder and checked against the hash it was tried as
(agent/review/integrate.py routes them in).
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Callable

from agent.history import CandidateRecord, History
from agent.report.numbers import times
from agent.review import dispatch
from tools.e2e import DroppedCandidate
from tools.hotspots import ProfileResult
from tools.problem import Problem
from tools.runfolder import RunFolder

MAX_TRIES = 3
"""Kept candidates tried per region, best first."""
NOT_FASTER = "not faster than the original beyond the noise band"


def expected_gain(share: float, speedup: float | None) -> float:
    """Fraction of the model's time a region's winner saves: share x (1 - 1/speedup)."""
    if not speedup or speedup <= 0 or not math.isfinite(speedup):
        return -math.inf
    return share * (1.0 - 1.0 / speedup)


def plans(run: RunFolder, problems: list[Problem], history: History, max_tries: int, note: Callable[[str], None],
          dropped: list[DroppedCandidate]) -> list[tuple[Problem, list[CandidateRecord]]]:
    """Per region with a winner, what is tried to route in, best first: its per-shape dispatcher,
    then at most `max_tries` winners; the regions by expected gain. A region with no kept
    candidate is noted, one whose kept candidates are not faster dropped."""
    planned = []
    for p in problems:
        gens = history.targets(p.name)
        kept = history.kept(p.name)
        if not kept:
            tried = sum(history.counts(p.name).values())
            note(f"{p.name}: " + ("no trial ran on it" if not tried else
                                  "no candidate passed on every target generation") + "; the original stays")
            continue
        wins = [r for r in kept if all(r.by_generation[g].win for g in gens)]
        shaped = dispatch.region_dispatcher(run, p, kept, gens, wins[0] if wins else None,
                                            lambda r: candidate_source(run, r)[0])
        if not wins and shaped is None:
            dropped.append(DroppedCandidate(region=p.name, candidate_hash=kept[0].candidate_hash,
                                            reason=f"{NOT_FASTER} (best kept {times(kept[0].score(gens))})"))
            continue
        # The per-shape choice first: on every workload it is at least as fast as the best single one.
        tries = ([shaped[0]] if shaped else []) + wins[:max_tries]
        score = shaped[1] if shaped else wins[0].score(gens)
        planned.append((expected_gain(p.share_of_model, score), score, p, tries))
    planned.sort(key=lambda x: (-x[0], -x[1]))
    return [(p, tries) for _, _, p, tries in planned]


def sourced(run: RunFolder, planned: list[tuple[Problem, list[CandidateRecord]]], dropped: list[DroppedCandidate]
            ) -> list[tuple[Problem, list[tuple[CandidateRecord, str]]]]:
    """Per planned region, the candidates to try whose source is still the one tried, with it; the
    others are dropped with the reason."""
    out = []
    for p, tries in planned:
        readable = []
        for rec in tries:
            source, why = candidate_source(run, rec)
            if source is None:
                dropped.append(DroppedCandidate(region=p.name, candidate_hash=rec.candidate_hash, reason=why))
            else:
                readable.append((rec, source))
        if readable:
            out.append((p, readable))
    return out


def candidate_path(run: RunFolder, rec: CandidateRecord) -> Path:
    recorded = [t.candidate_path for t in rec.by_generation.values() if t.candidate_path]
    for p in recorded:
        if Path(p).is_file():
            return Path(p)
    return run.candidates_dir / f"{rec.candidate_hash}.py"


def candidate_source(run: RunFolder, rec: CandidateRecord) -> tuple[str | None, str]:
    path = candidate_path(run, rec)
    try:
        source = path.read_text()
    except OSError as e:
        return None, f"source not found: {path} ({e.strerror})"
    if hashlib.sha256(source.encode()).hexdigest()[:16] != rec.candidate_hash:
        return None, f"source changed: {path} no longer has the content that was tried"
    return source, ""


def model_floors(run: RunFolder, model: Problem) -> dict[str, float]:
    """The whole model's roofline floor per workload: frozen with it, else the profile's (the
    model's row in hotspots.json: a run frozen before the whole model carried one)."""
    floors = {k: v for k, v in model.floor_ms.items() if v}
    if all(w.name in floors for w in model.workloads):
        return floors
    try:
        profile = ProfileResult.load(run.path / "hotspots.json")
    except (OSError, ValueError):
        return floors
    for w in profile.workloads:
        root = next((r for r in w.rows if r.path == ""), None)
        if w.name not in floors and root is not None and root.floor_ms:
            floors[w.name] = root.floor_ms
    return floors
