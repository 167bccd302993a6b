"""Which candidate `agent apply` writes for each region, and why the others are left out.

Winners are the regions integration kept end to end (`integration.json`'s `accepted`) when that
file exists, otherwise the best kept candidate per region in the run's store. A winner that is
not faster than the original (integration drops those; a store winner can be one, e.g. after
`agent try` of a slow candidate) is left out with the reason, unless the user asks for it with
`allow_slower`; then it is applied with a warning. Candidates integration dropped for their
end-to-end error are never applied.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agent.errors import UserError
from tools.e2e import IntegrationResult
from tools.problem import Problem
from tools.runfolder import RunFolder
from tools.trial import Candidate

NOT_FASTER = "not faster than the original"
"""How integration (agent/review/integrate.py) words a drop for speed rather than for accuracy."""


class CandidateSkipped(Exception):
    """A region's candidate cannot be used; the message says why. Reported, not fatal."""


@dataclass
class Winner:
    region: str
    """Problem name (folder name)."""
    region_class: str
    """Qualified name of the module class whose forward is replaced."""
    candidate_hash: str
    source: str
    speedup: float | None = None
    error: float | None = None
    tolerance: str = ""
    timing: str = ""
    """`cpu`, or the GPU generations it was timed on."""
    planner: str = ""
    template: str | None = None
    chosen_by: str = "store"
    """`integration` (kept end to end), `integration-slower` (integration dropped it as not faster;
    applied because of --allow-slower) or `store` (best kept candidate; no integration.json)."""
    class_module: str | None = None
    """Module the class is defined in when that is not the model file (e.g. transformers'
    `transformers.models.llama.modeling_llama`): routed at run time, never edited."""
    under_compile: list[str] | None = None
    """Input shapes ("*": every call) where under torch.compile the region's own code runs,
    compiled with the rest: torch.compile of the region was as fast (integration.json)."""
    verified: list[str] | None = None
    """Fingerprints (tools/fingerprint.py) of the instances the winner was verified on: every
    instance in the model when integration kept it end to end, else the region's frozen one.
    Only those are routed through it; None (a run frozen before fingerprints): every instance."""


def candidate_source(run: RunFolder, digest: str, path: str) -> str:
    """The candidate's source by hash from the run's candidates/ folder (canonical), else the
    recorded path; its hash must match (a candidate edited after the run is not the winner)."""
    tried = [run.candidates_dir / f"{digest}.py"]
    if path:
        p = Path(path)
        tried += [p] if p.is_absolute() else [run.path / p, Path.cwd() / p, run.path.parent.parent / p]
    for p in tried:
        if p.is_file():
            source = p.read_text()
            if Candidate(region="", source=source).hash != digest:
                raise CandidateSkipped(f"candidate {digest}: {p} no longer matches its hash")
            return source
    raise CandidateSkipped(f"candidate {digest}: source not found (looked in {run.candidates_dir})")


def resolve_regions(problems: list[Problem], wanted: list[str] | None, run: RunFolder) -> list[Problem]:
    if not wanted:
        return problems
    by_name = {p.name: p for p in problems} | {p.region_class: p for p in problems}
    chosen = []
    for name in wanted:
        if name not in by_name:
            known = ", ".join(p.name for p in problems) or "none"
            raise UserError(f"run {run.run_id} has no region {name!r} (regions: {known})")
        if by_name[name] not in chosen:
            chosen.append(by_name[name])
    return chosen


def load_integration(run: RunFolder) -> IntegrationResult | None:
    """integration.json, if integration has run; a file that does not read is named."""
    try:
        return IntegrationResult.load(run.path)
    except (ValueError, OSError) as e:
        first = " ".join(str(e).split())[:200]
        raise UserError(f"{run.path / 'integration.json'} cannot be read ({first}): run agent integrate "
                        f"{run.path} again, or remove the file to apply the store's best candidates") from None


def _timing(trials) -> str:
    gens = sorted({t.generation for t in trials})
    cpu = all(t.device.partition(":")[0].partition("@")[0] == "cpu" for t in trials)
    return "cpu" if cpu else ", ".join(gens)


def select_winners(run: RunFolder, regions: list[str] | None = None, allow_slower: bool = False
                   ) -> tuple[list[Winner], dict[str, str], str, list[str]]:
    """(winners in the run's problem order, {region: why it has none}, 'integration'|'store',
    warnings)."""
    from agent.history import load_history
    problems = run.problems()
    if not problems:
        raise UserError(f"{run.path}: the run has no frozen problems")
    chosen = resolve_regions(problems, regions, run)
    history = load_history(run, problems, [])
    integration = load_integration(run)
    chosen_by = "integration" if integration is not None else "store"
    winners, skipped, warnings = [], {}, []
    for p in chosen:
        gens = history.targets(p.name)
        try:
            if integration is not None:
                acc = next((a for a in integration.accepted if a.region == p.name), None)
                drop = next((d for d in integration.dropped if d.region == p.name), None)
                origin = "integration"
                if acc is None and drop is not None and drop.reason.startswith(NOT_FASTER) and allow_slower:
                    rec = history.records.get((p.name, drop.candidate_hash))
                    digest, path, speedup = drop.candidate_hash, "", (rec.score(gens) if rec else None)
                    origin = "integration-slower"
                    warnings.append(f"{p.name}: candidate {digest} is {drop.reason} (integration.json); applied "
                                    "because of --allow-slower")
                elif acc is None:
                    why = drop.reason if drop is not None else ""
                    hint = "; --allow-slower applies it anyway" if why.startswith(NOT_FASTER) else ""
                    raise CandidateSkipped("not kept end to end by integration" + (f": {why}" if why else "") + hint)
                else:
                    rec = history.records.get((p.name, acc.candidate_hash))
                    digest, path, speedup = acc.candidate_hash, acc.candidate_path, acc.region_speedup
                planner, template = (rec.planner, rec.template) if rec else (acc.planner, acc.template) if acc \
                    else ("", None)
            else:
                rec = history.best(p.name)
                if rec is None:
                    tried = len(history.region_records(p.name))
                    raise CandidateSkipped(f"no kept candidate: {tried} tried, none kept" if tried
                                           else "no candidate tried")
                digest, path, speedup = rec.candidate_hash, "", rec.score(gens) or None
                planner, template = rec.planner, rec.template
                origin = "store"
            trials = list(rec.by_generation.values()) if rec is not None else []
            path = path or next((t.candidate_path for t in trials if t.candidate_path), "")
            timing = _timing(trials) if trials else p.device
            if origin == "store":
                warnings += _store_winner_faster(p.name, digest, speedup, trials, timing, allow_slower)
            errors = [t.error for t in trials if t.error is not None]
            verified = _verified_instances(p, origin)
            if verified is None:
                warnings.append(f"{p.name}: the run was frozen before instance fingerprints: its winner is routed "
                                f"into every instance of {p.region_class}, verified or not")
            winners.append(Winner(
                region=p.name, region_class=p.region_class, candidate_hash=digest,
                source=candidate_source(run, digest, path), speedup=speedup,
                error=max(errors) if errors else None, tolerance=str(p.tolerance), timing=timing,
                planner=planner, template=template, chosen_by=origin, verified=verified,
                under_compile=acc.under_compile if integration is not None and acc is not None else None))
        except CandidateSkipped as e:
            skipped[p.name] = str(e)
    if integration is not None and integration.accepted and integration.speedup is not None \
            and integration.speedup <= 1.0 and winners:
        kind = "CPU timing" if integration.timing_kind == "cpu" else f"on {integration.generation or integration.device}"
        warnings.append(f"end to end, the tuned model measured {integration.speedup:.2f}x the original's speed "
                        f"({kind}; integration.json): it is not faster as a whole")
    return winners, skipped, chosen_by, warnings


def _store_winner_faster(region: str, digest: str, speedup: float | None, trials: list, timing: str,
                         allow_slower: bool) -> list[str]:
    """A store winner counts as faster only beyond its noise band on every generation, as
    integration judges (its own verdicts are taken as they are): raises CandidateSkipped where it
    is not, or returns the warning --allow-slower gives instead."""
    if all(t.win for t in trials):
        return []
    band = max((t.noise_band or 0.0 for t in trials), default=0.0)
    label = (f"{speedup:.2f}x, inside its noise band ±{band:.0%}" if speedup and speedup > 1 else
             f"{speedup:.2f}x" if speedup else "not timed") + (", CPU timing" if timing == "cpu" else f", on {timing}")
    if not allow_slower:
        raise CandidateSkipped(f"{NOT_FASTER} ({label}); --allow-slower applies it anyway")
    return [f"{region}: candidate {digest} is {NOT_FASTER} ({label}); applied because of --allow-slower"]


def _verified_instances(p, origin: str) -> list[str] | None:
    """The instance fingerprints a winner was verified on: end to end every instance of the model
    ran it, else the frozen one did; None for a run frozen before fingerprints."""
    if not p.fingerprints:
        return None
    if origin == "integration":
        return sorted(set(p.fingerprints.values()))
    return [p.fingerprints[p.region_path]] if p.region_path in p.fingerprints else None
