"""report.html: the morning report as one self-contained page. It opens from disk with no
server and no network: the stylesheet is inline, the plots are inline SVG, the diffs are
highlighted by pygments into inline styles. Nothing references an outside URL."""

from __future__ import annotations

import difflib
import time
from functools import lru_cache
from html import escape

from pygments.lexers import PythonLexer
from pygments.styles import get_style_by_name

from agent.report.data import MAX_EXAMPLES, RegionView, ReportData, run_state
from agent.report.numbers import (cpu_headline, device_time, e2e_speedup, e2e_verdict, fmt_err, fmt_params, fmt_ms,
                                  fmt_speedup, standings, tidy, weighted_totals, within)
from agent.report.plots import plots

MAX_DIFF_LINES = 600
CSS = """
body{font:14px/1.5 -apple-system,'Segoe UI',Helvetica,Arial,sans-serif;color:#24292f;margin:0;background:#f6f8fa}
main{max-width:1100px;margin:0 auto;padding:24px 32px 48px;background:#fff}
h1{font-size:24px;margin:0 0 4px}h2{font-size:19px;border-bottom:1px solid #d0d7de;padding-bottom:4px;margin-top:32px}
h3{font-size:16px;margin:24px 0 6px}.muted{color:#57606a}.banner{background:#fff8c5;border:1px solid #d4a72c;
padding:8px 12px;border-radius:6px;margin:12px 0}.cards{display:flex;flex-wrap:wrap;gap:12px;margin:12px 0}
.card{border:1px solid #d0d7de;border-radius:8px;padding:10px 14px;min-width:150px;flex:1}
.card .v{font-size:22px;font-weight:600}.card .k{color:#57606a;font-size:12px}
table{border-collapse:collapse;margin:8px 0 12px;font-size:13px}th,td{border:1px solid #d0d7de;padding:4px 8px;text-align:left}
th{background:#f6f8fa}td.n{text-align:right;font-variant-numeric:tabular-nums}.ok{color:#1a7f37;font-weight:600}
.bad{color:#cf222e;font-weight:600}.fast{background:#dafbe1}code{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:12.5px}
.plots{display:flex;flex-wrap:wrap;gap:12px}.plots svg{max-width:100%;height:auto;border:1px solid #d0d7de;border-radius:6px}
.diff{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:12px;border:1px solid #d0d7de;border-radius:6px;
overflow-x:auto;margin:8px 0}.diff .l{white-space:pre;padding:0 8px 0 0;display:flex}.diff .no{color:#8c959f;min-width:36px;
text-align:right;padding-right:6px;user-select:none}.diff .s{width:14px;text-align:center;user-select:none}
.diff .add{background:#e6ffec}.diff .del{background:#ffebe9}.diff .hunk{background:#ddf4ff;color:#57606a}
.diff .head{background:#f6f8fa;font-weight:600}section.region{border-top:1px solid #eaeef2;margin-top:18px}
"""


# -- syntax-highlighted diff -------------------------------------------------------------------
STYLE = get_style_by_name("default")


@lru_cache(maxsize=None)
def _css(ttype) -> str:
    s = STYLE.style_for_token(ttype)
    parts = [f"color:#{s['color']}"] if s["color"] else []
    parts += ["font-weight:bold"] if s["bold"] else []
    parts += ["font-style:italic"] if s["italic"] else []
    return ";".join(parts)


def highlight_lines(source: str) -> list[str]:
    """Python source as HTML, one string per line, with inline-styled spans (a token that
    spans lines, like a docstring, is split at the line ends)."""
    lines: list[list[str]] = [[]]
    for ttype, text in PythonLexer(stripnl=False, ensurenl=False).get_tokens(source):
        for k, part in enumerate(text.split("\n")):
            if k:
                lines.append([])
            if part:
                css = _css(ttype)
                lines[-1].append(f'<span style="{css}">{escape(part)}</span>' if css else escape(part))
    html = ["".join(parts) for parts in lines]
    want = source.split("\n")
    return html if len(html) == len(want) else [escape(line) for line in want]


def diff_html(old: str, new: str, old_name: str, new_name: str, context: int = 3) -> str:
    """A unified diff of two Python sources, both sides highlighted, with line numbers."""
    old, new = old.removesuffix("\n"), new.removesuffix("\n")
    a, b = old.split("\n"), new.split("\n")
    ha, hb = highlight_lines(old), highlight_lines(new)

    def row(cls: str, sign: str, i: int | None, j: int | None, code: str) -> str:
        no = lambda n: f'<span class="no">{"" if n is None else n + 1}</span>'
        return f'<div class="l {cls}">{no(i)}{no(j)}<span class="s">{sign}</span><span>{code or " "}</span></div>'

    out = [f'<div class="l head"><span>--- {escape(old_name)}</span></div>',
           f'<div class="l head"><span>+++ {escape(new_name)}</span></div>']
    shown = 0
    for group in difflib.SequenceMatcher(None, a, b, autojunk=False).get_grouped_opcodes(context):
        i1, j1 = group[0][1], group[0][3]
        i2, j2 = group[-1][2], group[-1][4]
        out.append(f'<div class="l hunk"><span>@@ -{i1 + 1},{i2 - i1} +{j1 + 1},{j2 - j1} @@</span></div>')
        for tag, a1, a2, b1, b2 in group:
            if tag == "equal":
                out += [row("", " ", a1 + k, b1 + k, hb[b1 + k]) for k in range(b2 - b1)]
                continue
            out += [row("del", "-", i, None, ha[i]) for i in range(a1, a2)]
            out += [row("add", "+", None, j, hb[j]) for j in range(b1, b2)]
        shown = len(out)
        if shown > MAX_DIFF_LINES:
            out.append('<div class="l hunk"><span>… diff cut here; the full file is in the run folder</span></div>')
            break
    return '<div class="diff">' + "\n".join(out) + "</div>"


# -- the page ----------------------------------------------------------------------------------
def _table(head: list[str], rows: list[list[str]], numeric: set[int] = frozenset()) -> str:
    th = "".join(f"<th>{h}</th>" for h in head)
    body = "".join("<tr>" + "".join(f'<td class="n">{c}</td>' if i in numeric else f"<td>{c}</td>"
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _err(error: float | None, tolerance: str) -> str:
    ok = within(error, tolerance)
    cls = {True: "ok", False: "bad", None: ""}[ok]
    return f'<span class="{cls}">{escape(fmt_err(error, tolerance))}</span>'


def _card(value: str, key: str) -> str:
    return f'<div class="card"><div class="v">{value}</div><div class="k">{key}</div></div>'


def _summary(data: ReportData) -> list[str]:
    res, trials = data.integration, data.history.trials
    spent = device_time(data.gpu_seconds, data.cpu_only)
    sp = e2e_speedup(res) if res else None
    said = e2e_verdict(res) if res else ""
    e2e = (f"{sp:.2f}x" if said != "no change" else f"no change ({sp:.2f}x)") if sp else "not yet"
    e2e_key = ("end-to-end speedup, weighted" + (f", A/A noise band ±{res.noise_band or 0.0:.1%}" if sp else "")
               ) if res else "end to end: integration has not run yet"
    outside = [w.name for w in res.workloads if within(w.error, w.tolerance) is False] if res else []
    if res is not None and res.timing_kind == "cpu":  # correctness only: a CPU timing is no speedup
        e2e, e2e_key = "correctness only", escape(cpu_headline(res))
    if outside:
        e2e_key += f'; <span class="bad">error outside the tolerance on {escape(", ".join(outside))}</span>'
    out = ['<section id="summary"><h2>Summary</h2>', '<div class="cards">', _card(escape(e2e), e2e_key),
           _card(f"{len(trials)}", f"trials run ({sum(r.counts.get('ok', 0) for r in data.regions)} passed)"),
           _card(f"{data.kept}", "candidates kept (passed on every target generation)"),
           _card(escape(spent.split(" ", 1)[0]), escape(spent.split(" ", 1)[1]) + " spent"),
           _card(f"${data.usd:.2f}", "spent on LLM calls"), "</div>",
           f"<p>{escape(run_state(data))}</p>",
           *(f"<p class='bad'>Planner stopped: {escape(tidy(why))}</p>" for why in data.planner_stops),
           *([f"<p class='bad'>Not jailed: {escape(data.unjailed)}</p>"] if data.unjailed else [])]
    if res is None:
        out.append(f"<p><b>{escape(data.integration_error or 'Integration has not run yet')}</b>: there are no "
                   "end-to-end numbers for this run; the per-region results below are from the search alone.</p>")
        return out + ["</section>"]
    kind = "CPU timings, not GPU numbers" if res.timing_kind == "cpu" else "GPU timings"
    out.append(f"<h3>End to end on {escape(res.device_name or res.device)} (generation "
               f"{escape(res.generation or '?')}; {kind})</h3>")
    unit = "CPU ms" if res.timing_kind == "cpu" else "ms"
    rows = [[escape(w.name), escape(res.generation or "?"), f"{w.weight:g}", fmt_ms(w.eager_ms), fmt_ms(w.tuned_ms),
             "-" if w.speedup is None else f"<b>{escape(fmt_speedup(w))}</b>", _err(w.error, w.tolerance)] for w in res.workloads]
    out.append(_table(["workload", "generation", "weight", f"eager {unit}", f"tuned {unit}", "speedup",
                       "error / tolerance"], rows, {2, 3, 4, 5}))
    names = list(dict.fromkeys(n for w in res.workloads for n in w.baselines))
    if names:
        out.append(f"<h3>Against torch.compile ({unit})</h3>")
        rows = []
        for w in res.workloads:
            times, verdict = standings(w)
            best = min((ms for _, ms in times if ms), default=None)
            cell = lambda ms, name: ("failed" + (f": {escape(res.baseline_errors[name][:80])}" if name in res.baseline_errors
                                                 else "") if ms is None else
                                     f'<span class="{"ok" if ms == best else ""}">{ms:.4g}</span>')
            lookup = dict(times)
            rows.append([escape(w.name), *(cell(lookup.get(n), n) for n in ["eager", "nightshift", *names]),
                         escape(verdict)])
        out.append(_table(["workload", "eager", "nightshift", *map(escape, names), "fastest"], rows,
                          set(range(1, 3 + len(names)))))
        for name, why in res.baseline_fallbacks.items():
            out.append(f"<p class='muted'>{escape(name)}: torch.compile {escape(why)}; its time is not the compiler's.</p>")
    else:
        out.append("<p class='muted'>No torch.compile baselines were recorded by integration.</p>")
    if len(res.workloads) > 1:
        totals = weighted_totals(res)
        out.append(f"<h3>Weighted total over the workloads ({unit}; with a request trace: what it costs)</h3>")
        out.append(_table([escape(n) for n, _ in totals], [["failed" if t is None else f"{t:.4g}" for _, t in totals]],
                          set(range(len(totals)))))
    if res.accepted:
        out.append("<p>Applied: " + ", ".join(f"{escape(a.region)} (<code>{escape(a.candidate_hash)}</code>"
                                              + (f", {a.region_speedup:.2f}x alone" if a.region_speedup else "") + ")"
                                              for a in res.accepted) + ".</p>")
    out += [f"<p>Dropped {escape(d.region)} <code>{escape(d.candidate_hash)}</code>: {escape(tidy(d.reason))}.</p>"
            for d in res.dropped]
    out += [f"<p class='muted'>{escape(tidy(str(n)))}</p>" for n in getattr(res, "notes", [])]
    return out + ["</section>"]


def _overview(data: ReportData) -> str:
    rows = []
    for r in data.regions:
        b, p = r.best, r.problem
        err = _err(next(iter(b.by_generation.values())).error, str(p.tolerance)) if b else f"- / {escape(str(p.tolerance))}"
        per_gen = ", ".join(f"{escape(g)} {s:.2f}x ({data.kind(g)})" for g, s in sorted(b.speedups().items())) if b else "-"
        speed = ([f"<code>{escape(b.candidate_hash)}</code>" if b else "-"] if data.cpu_only else
                 [f"<b>{r.score:.2f}x</b>" if b else "-", per_gen])
        rows.append([f'<a href="#region-{escape(p.name)}">{escape(p.name)}</a>', f"{p.share_of_model:.0%}",
                     str(sum(r.counts.values())), str(r.counts.get("ok", 0)), str(r.kept), *speed, err,
                     escape(f"{b.planner} / {b.template or '-'}") if b else "-"])
    # A CPU run shows correctness only: its best candidate, never a speedup.
    speed = ["best candidate (CPU run: correctness only)"] if data.cpu_only else ["best speedup", "per generation"]
    return _table(["region", "share of model", "trials", "passed", "kept", *speed, "error / tolerance",
                   "planner / template"], rows, {1, 2, 3, 4, 5}) if rows else ""


def _region(data: ReportData, r: RegionView) -> str:
    p, b = r.problem, r.best
    out = [f'<section class="region" id="region-{escape(p.name)}"><h3>{escape(p.name)}</h3>',
           f"<p class='muted'><code>{escape(p.region_class)}</code> · {p.share_of_model:.0%} of the model · tolerance "
           f"{escape(str(p.tolerance))} ({escape(p.tolerance_source)}) · {sum(r.counts.values())} trials, "
           f"{r.counts.get('ok', 0)} passed, {r.kept} kept · target generations "
           f"{escape(', '.join(r.gens) or '-')}</p>"]
    if not b:
        return "\n".join(out + ["<p>No candidate passed the tolerance on every target generation yet.</p></section>"])
    per_gen = ", ".join(f"{escape(g)} {s:.2f}x ({data.kind(g)} timing)" for g, s in sorted(b.speedups().items()))
    params = f" with <code>{escape(fmt_params(b.params))}</code>" if fmt_params(b.params) else ""
    score = "" if data.cpu_only else f"<b>{r.score:.2f}x</b> ({per_gen}) — "
    out.append(f"<p>Best: {score}<code>{escape(b.candidate_hash)}</code>, found by "
               f"planner <b>{escape(b.planner)}</b>, template <b>{escape(b.template or '-')}</b>{params}.</p>")
    rows = []
    for g, t in sorted(b.by_generation.items()):
        unit = f"{data.kind(g)} ms"
        for w in t.timings:
            rows.append([f"{escape(g)} ({data.kind(g)})", escape(w.workload), f"{p.weights.get(w.workload, 0):.2f}",
                         f"{w.baseline_ms:.4g} {unit}", f"{w.candidate_ms:.4g} {unit}", f"{w.speedup:.2f}x",
                         _err(t.error, str(p.tolerance)), escape(", ".join(t.flags) or "-")])
    out.append(_table(["generation", "workload", "weight", "baseline", "best", "speedup", "error / tolerance", "flags"],
                      rows, {2, 3, 4, 5}))
    if r.source is None:
        out.append(f"<p class='bad'>The source of {escape(b.candidate_hash)} is missing: no file with its content "
                   f"was found (looked at {escape(', '.join(r.looked_at))}).</p>")
    else:
        out.append(f"<p class='muted'>The original <code>{escape(p.region_class)}.forward</code> against the "
                   f"candidate file that replaces it, <code>{escape(str(r.source_path))}</code>.</p>")
        out.append(diff_html(r.original_forward, r.source, f"{p.region_class}.forward (original)",
                             f"candidates/{b.candidate_hash}.py"))
    return "\n".join(out + ["</section>"])


def _rejected(data: ReportData) -> list[str]:
    out = ['<section id="rejected"><h2>Rejected candidates by reason</h2>']
    for r in data.regions:
        if not r.rejected:
            continue
        by_count = sorted(r.rejected.items(), key=lambda kv: -len(kv[1]))
        out.append(f"<h3>{escape(r.name)}</h3><p>" + ", ".join(f"<b>{escape(k)}</b> {len(v)}" for k, v in by_count)
                   + "</p>")
        rows = []
        for status, trials in by_count:
            shown = trials[-MAX_EXAMPLES:]
            label = escape(status) + (f" (last {len(shown)} of {len(trials)})" if len(trials) > len(shown) else "")
            rows += [[f"<code>{escape(t.candidate_hash)}</code>", escape(f"{t.planner} / {t.template or '-'}"),
                      escape(t.generation), label, escape(tidy(t.reason))] for t in shown]
        out.append(_table(["candidate", "planner / template", "generation", "status", "reason"], rows))
    if not any(r.rejected for r in data.regions):
        out.append("<p>None rejected.</p>")
    out += [f"<p>Region {escape(n)} was not frozen: {escape(tidy(why))}</p>" for n, why in data.info.skipped.items()]
    return out + ["</section>"]


def render_html(data: ReportData) -> str:
    info = data.info
    svgs = plots(data)
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(data.generated_at))
    versions = " · ".join(f"{k} {escape(v)}" for k, v in info.versions.items() if k in ("torch", "triton", "cuda") and v not in ("", "None"))
    body = [f"<h1>nightshift report: {escape(data.run.run_id)}</h1>",
            f"<p class='muted'>Model <code>{escape(info.model_file)}</code> · {versions} · generated {when}</p>",
            f"<div class='banner'>{escape(data.timing_note)}.</div>" if data.cpu_only else
            f"<p class='muted'>{escape(data.timing_note)}.</p>",
            *_summary(data),
            '<section id="progress"><h2>Search progress</h2><div class="plots">',
            *svgs.values(), "</div></section>",
            '<section id="regions"><h2>Regions</h2>', _overview(data), *(_region(data, r) for r in data.regions),
            "</section>" if data.regions else "<p>No problems were frozen in this run.</p></section>",
            *_rejected(data),
            f"<p class='muted'>Rebuild with <code>agent report {escape(str(data.run.path))}</code>.</p>"]
    return ("<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<title>nightshift report: {escape(data.run.run_id)}</title><style>{CSS}</style></head>"
            "<body><main>\n" + "\n".join(body) + "\n</main></body></html>\n")
