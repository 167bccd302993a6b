"""report.md: the morning report as markdown (the same content as report.html, without styling)."""

from __future__ import annotations

from agent.report.data import MAX_EXAMPLES, RegionView, ReportData, run_state
from agent.report.numbers import (cpu_headline, device_time, e2e_headline, fmt_err, fmt_ms, fmt_params, fmt_speedup,
                                  standings, tidy, weighted_totals, within)


def render_md(data: ReportData, images: dict[str, str] | None = None) -> str:
    info, L = data.info, []
    L += [f"# nightshift report: {data.run.run_id}", "",
          f"Model `{info.model_file}` · {len(data.history.trials)} trials · "
          f"{device_time(data.gpu_seconds, data.cpu_only)} · ${data.usd:.2f} of LLM calls · {data.timing_note}", "",
          run_state(data), ""]
    L += [f"**Not jailed:** {data.unjailed}", ""] if data.unjailed else []
    L += [f"**Planner stopped:** {tidy(why)}" for why in data.planner_stops]
    L += ([""] if data.planner_stops else []) + ["## End to end", ""]
    L += _md_integration(data) + _md_totals(data)
    # A CPU run shows correctness only: its best candidate, never a speedup.
    speed = "best candidate (CPU run: correctness only)" if data.cpu_only else "best speedup | per generation"
    L += ["", "## Regions", "",
          f"| region | share of model | trials | passing | {speed} | error / tolerance | template |",
          "|---|---|---|---|---|---|---|" + ("" if data.cpu_only else "---|")]
    for r in data.regions:
        p, best, counts = r.problem, r.best, r.counts
        if best:
            per_gen = ", ".join(f"{g} {s:.2f}x ({data.kind(g)})" for g, s in sorted(best.speedups().items()))
            err = next(iter(best.by_generation.values())).error
            won = f"`{best.candidate_hash}`" if data.cpu_only else f"{r.score:.2f}x | {per_gen}"
            L.append(f"| {p.name} | {p.share_of_model:.0%} | {sum(counts.values())} | {counts.get('ok', 0)} | "
                     f"{won} | {fmt_err(err, str(p.tolerance))} | {best.template or '-'} |")
        else:
            L.append(f"| {p.name} | {p.share_of_model:.0%} | {sum(counts.values())} | {counts.get('ok', 0)} | - | "
                     + ("" if data.cpu_only else "- | ") + f"- / {p.tolerance} | - |")
    if images:
        L += [""] + [f"![{alt}]({src})" for alt, src in images.items()]
    for r in data.regions:
        L += ["", f"### {r.name}", ""] + _md_region(data, r)
    L += ["", "## Rejected candidates by reason", ""]
    for r in data.regions:
        if not r.rejected:
            continue
        L.append(f"- **{r.name}**: " + ", ".join(f"{k} {len(v)}" for k, v in sorted(r.rejected.items())))
        for status, trials in sorted(r.rejected.items()):
            shown = trials[-MAX_EXAMPLES:]
            more = f" (the last {len(shown)} of {len(trials)})" if len(trials) > len(shown) else ""
            L.append(f"  - {status}{more}:")
            for t in shown:
                L.append(f"    - `{t.candidate_hash}` ({t.planner}/{t.template or '-'}, {t.generation}): "
                         f"{tidy(t.reason)}")  # whole: a reason cut short says something else
    for name, why in info.skipped.items():
        L.append(f"- region {name} was not frozen: {tidy(why)}")
    return "\n".join(L) + "\n"


def _md_integration(data: ReportData) -> list[str]:
    res = data.integration
    if res is None:
        return [data.integration_error or "Integration has not run yet: no end-to-end numbers for this run."]
    kind = "CPU timings, not GPU numbers" if res.timing_kind == "cpu" else "GPU timings"
    unit = "CPU ms" if res.timing_kind == "cpu" else "ms"
    L = [f"On {res.device_name or res.device} (generation {res.generation or '?'}; {kind}): "
         + (f"**correctness only**: {cpu_headline(res)}" if res.timing_kind == "cpu" else e2e_headline(res))
         + "".join(f" The error is OUTSIDE the tolerance on {w.name}." for w in res.workloads
                   if within(w.error, w.tolerance) is False), "",
         f"| workload | generation | eager {unit} | tuned {unit} | speedup | error / tolerance | fastest |",
         "|---|---|---|---|---|---|---|"]
    for w in res.workloads:
        L.append(f"| {w.name} | {res.generation or '?'} | {fmt_ms(w.eager_ms)} | {fmt_ms(w.tuned_ms)} | "
                 f"{fmt_speedup(w)} | {fmt_err(w.error, w.tolerance)} | "
                 f"{standings(w)[1]} |")
    names = list(dict.fromkeys(n for w in res.workloads for n in w.baselines))
    if names:
        L += ["", f"Against torch.compile ({unit}; failed: did not compile or run):", "",
              "| workload | eager | nightshift | " + " | ".join(names) + " |", "|---" * (3 + len(names)) + "|"]
        for w in res.workloads:
            t = dict(standings(w)[0])
            L.append(f"| {w.name} | " + " | ".join("failed" if t.get(n) is None else fmt_ms(t[n])
                                                  for n in ["eager", "nightshift", *names]) + " |")
    notes = [f"Applied {a.region} `{a.candidate_hash}`" + (f" ({a.region_speedup:.2f}x alone)." if a.region_speedup
                                                           else ".") for a in res.accepted]
    notes += [f"Dropped {d.region} `{d.candidate_hash}`: {tidy(d.reason)}." for d in res.dropped]
    notes += [f"Baseline {k} failed: {tidy(v)}." for k, v in res.baseline_errors.items()]
    notes += [f"{k}: torch.compile {tidy(v)}; its time is not the compiler's." for k, v in res.baseline_fallbacks.items()]
    notes += [tidy(str(n)) for n in getattr(res, "notes", [])]
    return L + ([""] + [f"- {n}" for n in notes] if notes else [])


def _md_totals(data: ReportData) -> list[str]:
    """The mix's weighted total per way of running the model: with a request trace, what it costs."""
    res = data.integration
    if res is None or len(res.workloads) < 2:
        return []
    unit = "CPU ms" if res.timing_kind == "cpu" else "ms"
    trace = (data.info.options or {}).get("trace")
    what = (f"the trace `{trace}` (weight = calls of each shape in it, so this is its device time)" if trace
            else "the workloads (sum of weight x time)")
    totals = weighted_totals(res)
    return ["", f"Weighted total over {what}, {unit}:", "",
            "| " + " | ".join(n for n, _ in totals) + " |", "|---" * len(totals) + "|",
            "| " + " | ".join("failed" if t is None else f"{t:.4g}" for _, t in totals) + " |"]


def _md_region(data: ReportData, r: RegionView) -> list[str]:
    p = r.problem
    L = [f"`{p.region_class}` · {p.share_of_model:.0%} of the model · tolerance {p.tolerance} ({p.tolerance_source}) · "
         f"{sum(r.counts.values())} trials, {r.kept} kept"]
    if not r.best:
        return L + ["", "No candidate passed the tolerance on every target generation yet."]
    b, unit = r.best, "CPU ms" if data.cpu_only else "ms"
    params = fmt_params(b.params)
    L += ["", f"Best: `{b.candidate_hash}` from planner {b.planner}, template {b.template or '-'}"
          + (f" ({params})" if params else "")
          + ("" if data.cpu_only else f" · speedup {r.score:.2f}x (smallest over generations)"), "",
          f"| generation | workload | weight | baseline {unit} | best {unit} | speedup | error / tolerance |",
          "|---|---|---|---|---|---|---|"]
    for g, t in sorted(b.by_generation.items()):
        for w in t.timings:
            L.append(f"| {g} ({data.kind(g)}) | {w.workload} | {p.weights.get(w.workload, 0):.2f} | "
                     f"{w.baseline_ms:.4g} | {w.candidate_ms:.4g} | {w.speedup:.2f}x | {fmt_err(t.error, str(p.tolerance))} |")
    diff = r.unified_diff()
    if diff:
        L += ["", f"The original `{p.region_class}.forward` against the candidate file that replaces it:", "",
              "```diff", *diff, "```"]
    else:
        L += ["", f"(The source of `{b.candidate_hash}` is missing: no file with its content was found; looked at "
              + ", ".join(r.looked_at) + ".)"]
    return L
