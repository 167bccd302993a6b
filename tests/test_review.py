"""The morning review tells the truth: the report (what won, its diff, what was rejected, in
numbers a person reads; report.md and report.html saying the same things) and `agent apply` (a command that works as printed, a patch never lost,
no slower winner applied unasked, a patched model that runs on a machine without a GPU)."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from html.parser import HTMLParser

from agent import report
from agent.apply import apply_run
from agent.report.view import Chart, Diff
from tests.test_apply import EXAMPLE, ENV, git, make_run
from tools.e2e import AcceptedRegion, DroppedCandidate, IntegrationResult, WorkloadResult
from tools.runfolder import RunFolder
from tools.trial import Candidate, Status, Trial, WorkloadTiming

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "models" / "tiny_rmsnorm.py"
RIGHT = """import torch

def forward(module, x):
    xf = x.float()
    return module.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.eps)).to(x.dtype)
"""


@pytest.fixture(scope="module")
def profiled_tiny(tmp_path_factory) -> Path:
    from agent.setup.jobs import profile_and_freeze
    return profile_and_freeze(TINY, "cpu", None, tmp_path_factory.mktemp("review")).run.path


@pytest.fixture
def tiny(profiled_tiny, tmp_path) -> RunFolder:
    shutil.copytree(profiled_tiny, tmp_path / "run")
    return RunFolder(tmp_path / "run")


def record(run: RunFolder, source: str, status: Status, speedup: float | None = None, reason: str = "",
           params: dict | None = None, **fields) -> str:
    c = Candidate(region="RMSNorm", source=source)
    path = run.save_candidate(source, c.hash)
    timings = [WorkloadTiming(workload="default", baseline_ms=0.16, candidate_ms=0.16 / speedup, baseline_spread=0.01,
                              candidate_spread=0.01, reps=10, speedup=speedup, timing_kind="cpu")] if speedup else []
    store = run.store()
    store.record(Trial(region="RMSNorm", candidate_hash=c.hash, candidate_path=str(path), status=status,
                       speedup=speedup, error=7.152557373046875e-07 if status is Status.ok else 0.5,
                       tolerance="abs 0.0001", reason=reason, params=params or {}, template="rmsnorm",
                       planner="template", timings=timings, device="cpu", generation="cpu", **fields))
    store.close()
    return c.hash


# -- the report ------------------------------------------------------------------------------
def test_the_report_reads_like_a_person_wrote_it(tiny):
    best = record(tiny, RIGHT, Status.ok, 1.4, "within tolerance",
                  params={"binding": {"weight": "weight", "eps": 1e-06}, "tune": {"BLOCK_N": 1024, "num_warps": 8},
                          "template_source": "x" * 5000})
    for i in range(5):
        record(tiny, RIGHT + f"# wrong {i}\n", Status.wrong,
               reason=f"error 0.{i}4310243129730225 > tolerance abs 0.0001")
    record(tiny, RIGHT + "# nan\n", Status.nan, reason="3 outputs are NaN")
    text = report.write(tiny).read_text()

    best_line = next(ln for ln in text.splitlines() if ln.startswith("Best:"))
    assert "{" not in best_line and "x" * 50 not in best_line, best_line  # no raw dict, no whole source
    assert "BLOCK_N=1024, num_warps=8" in best_line and "weight←weight" in best_line

    # The original forward against the candidate: the constructor did not change, so it is not there.
    diff = text[text.index("```diff"):text.index("```", text.index("```diff") + 3)]
    assert diff.startswith("```diff\n--- RMSNorm.forward (original)\n+++ candidates/")
    assert "-def forward(self, x):" in diff and "+def forward(module, x):" in diff and "__init__" not in diff

    # Every count matches what is listed under it.
    assert "- **RMSNorm**: nan 1, wrong 5" in text
    assert "  - wrong (the last 3 of 5):" in text and "  - nan:" in text
    listed = [ln for ln in text.splitlines() if ln.startswith("    - `")]
    assert len(listed) == 4

    # Numbers as a person writes them: no float with sixteen digits anywhere, no GPU-h on the CPU.
    assert not re.search(r"\d\.\d{6,}", text), re.findall(r"\S*\d\.\d{6,}\S*", text)
    assert "0.443 > tolerance" in text and "GPU-h" not in text and "device-hours on the CPU" in text
    html = (tiny.path / "report.html").read_text()
    assert not re.search(r"\d\.\d{6,}", html) and "BLOCK_N=1024" in html and "{&#x27;" not in html
    assert "last 3 of 5" in html
    assert best in text


def test_the_report_never_shows_another_file_as_the_winner(tiny, tmp_path):
    best = record(tiny, RIGHT, Status.ok, 1.4)
    (tiny.candidates_dir / f"{best}.py").write_text("def forward(module, x):\n    return 'something else'\n")
    text = report.write(tiny).read_text()
    assert "something else" not in text and "something else" not in (tiny.path / "report.html").read_text()
    assert f"The source of `{best}` is missing: no file with its content was found" in text


def test_status_and_report_say_a_planner_stopped(tiny):
    store = tiny.store()
    store.event("planner_stopped", reason="anthropic planner stopped: anthropic m: HTTP 401: invalid x-api-key")
    store.close()
    text = report.write(tiny).read_text()
    assert "**Planner stopped:** anthropic planner stopped: anthropic m: HTTP 401: invalid x-api-key" in text


def facts(node) -> list[str]:
    """Every string the view states (fields marked layout place or draw, they state nothing)."""
    if isinstance(node, str):
        return [node] if node else []
    if isinstance(node, list):
        return [f for item in node for f in facts(item)]
    if dataclasses.is_dataclass(node):
        return [f for fld in dataclasses.fields(node) if not fld.metadata.get("layout")
                for f in facts(getattr(node, fld.name))]
    return []


def tagged(node, path: str, where: dict[str, str]):
    """The view with every fact replaced by a token that names its field, so that each template
    shows which fields it states. A diff keeps its lines and a chart its title: the HTML draws
    those from the diff's sources and inside the chart's SVG (the check on the real view sees them)."""
    if isinstance(node, str):
        token = f"⟦{len(where)}⟧"
        where[token] = path
        return token
    if isinstance(node, list):
        return [tagged(item, f"{path}[{i}]", where) for i, item in enumerate(node)]
    if dataclasses.is_dataclass(node) and not isinstance(node, (Diff, Chart)):
        return dataclasses.replace(node, **{fld.name: tagged(getattr(node, fld.name), f"{path}.{fld.name}", where)
                                            for fld in dataclasses.fields(node) if not fld.metadata.get("layout")})
    return node


class PageText(HTMLParser):
    """What a reader of report.html sees as text (entities decoded, the stylesheet left out), and
    its section headings."""

    def __init__(self, page: str):
        super().__init__()
        self.text, self.h2, self._skip, self._in_h2 = [], [], False, False
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        self._skip, self._in_h2 = tag == "style", tag == "h2"

    def handle_endtag(self, tag):
        self._skip = self._in_h2 = False

    def handle_data(self, data):
        if not self._skip:
            self.text.append(data)
        if self._in_h2:
            self.h2.append(data)


def test_report_md_and_html_say_the_same_things(tiny):
    """Both files render one view: every number, verdict and sentence in it is in each, under the
    same sections, whatever the run holds (integration over two workloads with a failed and a
    fallen-back baseline, a dropped candidate, rejections past the listed few, a stopped planner)."""
    best = record(tiny, RIGHT, Status.ok, 1.4, params={"tune": {"BLOCK_N": 1024}})
    for i in range(5):
        record(tiny, RIGHT + f"# wrong {i}\n", Status.wrong, reason=f"error 0.{i}4 > tolerance abs 0.0001")
    store = tiny.store()
    store.event("planner_stopped", reason="anthropic planner stopped: HTTP 401: invalid x-api-key")
    store.close()
    rows = [WorkloadResult(name="decode", weight=3, eager_ms=2.0, tuned_ms=1.6, speedup=1.25, error=2e-6,
                           tolerance="abs 0.0001", noise_band=0.05, verdict="faster", floor_ms=0.4,
                           baselines={"torch.compile": 1.5, "reduce-overhead": None}),
            WorkloadResult(name="prefill", weight=1, eager_ms=9.0, tuned_ms=8.9, speedup=1.01, error=0.5,
                           tolerance="abs 0.0001", noise_band=0.05, verdict="no change", floor_ms=3.5,
                           baselines={"torch.compile": 8.0, "reduce-overhead": 7.0})]
    IntegrationResult(device="cpu", device_name="host CPU", generation="cpu", timing_kind="cpu", noise_band=0.05,
                      workloads=rows, notes=["a note from integration"],
                      accepted=[AcceptedRegion(region="RMSNorm", candidate_hash=best, candidate_path="x.py",
                                               region_speedup=1.4)],
                      dropped=[DroppedCandidate(region="Other", candidate_hash="f" * 16, reason="slower end to end")],
                      baseline_errors={"reduce-overhead": "needs CUDA graphs"},
                      baseline_fallbacks={"torch.compile": "fell back to eager"}).save(tiny.path)

    view = report.build(report.collect(tiny))
    md, page = report.render_md(view), PageText(report.render_html(view))
    said = facts(view)
    # The walk reaches every part of the view: summary, integration, regions, diff, rejections.
    for fact in ("1.25x (faster, band ±5.0%)", "failed", "Weighted total over the workloads (sum of weight x time), "
                 "CPU ms", "Dropped Other ffffffffffffffff: slower end to end.", "anthropic planner stopped: HTTP "
                 "401: invalid x-api-key", "BLOCK_N=1024", "def forward(module, x):", "the last 3 of 5",
                 "error 0.44 > tolerance abs 0.0001", "0.5 / abs 0.0001 (OUTSIDE)", best, "25%", "weighted"):
        assert fact in said, fact
    assert [f for f in said if f not in md] == []
    assert [f for f in said if f not in "".join(page.text)] == []
    assert re.findall(r"^## (.+)$", md, re.M) == page.h2 == ["Summary", "Search progress", "Regions",
                                                           "Rejected candidates by reason"]

    # Field by field (a short fact such as "default" could be found elsewhere on the page): each
    # field one template states, the other states too. Unstated in both: what only a run without
    # integration, or without the winner's source, would say.
    where: dict[str, str] = {}
    view = tagged(view, "view", where)
    md_said = set(re.findall(r"⟦\d+⟧", report.render_md(view)))
    html_said = set(re.findall(r"⟦\d+⟧", report.render_html(view)))
    assert sorted(where[t] for t in md_said ^ html_said) == []
    assert sorted(where[t] for t in set(where) - md_said) == ["view.e2e.floor_missing", "view.e2e_missing",
                                                              "view.regions[0].winner.looked_at"]


# -- agent apply -----------------------------------------------------------------------------
def agent(*args, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **ENV, **(env or {})})


def test_the_apply_command_works_as_printed_from_anywhere(tmp_path, frozen_run):
    run, model = make_run(tmp_path, frozen_run)
    git(model.parent, "init", "-q")
    result = agent("apply", os.path.relpath(run, tmp_path), cwd=tmp_path)  # a relative run path, as typed
    assert result.returncode == 0, result.stderr
    command = next(ln for ln in result.stdout.splitlines() if ln.startswith("apply it: ")).removeprefix("apply it: ")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run(command, shell=True, cwd=elsewhere, capture_output=True, text=True)
    assert done.returncode == 0, (command, done.stderr)
    assert "_nightshift_install(globals())" in model.read_text()
    patch = run / "patches" / "llama.patch"
    good = patch.read_text()
    again = agent("apply", run, cwd=tmp_path)  # applied already: nothing to patch, the patch stays
    assert again.returncode == 0 and "already applied" in again.stdout, again.stderr
    assert patch.read_text() == good and good


def test_a_winner_slower_than_the_original_is_not_applied_unasked(tiny, tmp_path):
    model = tmp_path / "model" / "tiny.py"
    model.parent.mkdir()
    shutil.copy(TINY, model)
    info = tiny.info()
    info.model_file = str(model)
    tiny.write_info(info)
    slow = record(tiny, RIGHT, Status.ok, 0.12)
    result = agent("apply", tiny.path, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "RMSNorm: not applied (not faster than the original (0.12x, CPU timing); --allow-slower applies it " \
           "anyway)" in result.stdout
    assert not (model.parent / "tiny_nightshift.py").exists()
    forced = agent("apply", tiny.path, "--allow-slower", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert f"warning: RMSNorm: candidate {slow} is not faster than the original (0.12x, CPU timing); applied because " \
           "of --allow-slower" in forced.stderr
    assert (model.parent / "tiny_nightshift.py").is_file()

    # Integration's verdict decides when there is one: dropped for speed stays out unless asked.
    IntegrationResult(device="cpu", dropped=[DroppedCandidate(region="RMSNorm", candidate_hash=slow,
                                                              reason="not faster than the original (best kept 0.12x)")]
                      ).save(tiny.path)
    res = apply_run(tiny.path)
    assert not res.regions and "not kept end to end by integration: not faster" in res.skipped["RMSNorm"]
    assert apply_run(tiny.path, allow_slower=True).regions
    IntegrationResult(device="cpu", dropped=[DroppedCandidate(region="RMSNorm", candidate_hash=slow,
                                                              reason="end-to-end error 0.2 > tolerance abs 0.01")]
                      ).save(tiny.path)
    assert not apply_run(tiny.path, allow_slower=True).regions  # out of tolerance end to end: never


FALLBACK = textwrap.dedent('''
    import json, sys, warnings
    import torch
    from tools.modelfile import load_model
    ref = load_model(sys.argv[1], "cpu", check_forward=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new = load_model(sys.argv[2], "cpu", check_forward=False)
        routed = getattr(type(new.model.norm).forward, "__nightshift_region__", None)
        with torch.no_grad():
            same = [bool(torch.equal(ref.model(*w.inputs), new.model(*w.inputs))) for w in ref.workloads]
    ours = [str(w.message) for w in caught if "nightshift" in str(w.message)]
    print(json.dumps({"routed": routed, "same": same, "warnings": ours}))
''')


def test_the_patched_model_without_a_gpu_runs_the_original_forward_with_one_warning(tmp_path, frozen_run):
    run, model = make_run(tmp_path, frozen_run)
    res = apply_run(run)
    assert git(model.parent, "apply", res.patch_path).returncode == 0
    env = {k: v for k, v in {**os.environ, **ENV}.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", FALLBACK, str(EXAMPLE), str(model)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["routed"] == "LlamaRMSNorm"  # routed, and at call time it falls back
    assert out["same"] == [True] * 4  # one per workload: the original forward ran, bit for bit the original outputs
    assert len(out["warnings"]) == 1 and "need a GPU" in out["warnings"][0], out["warnings"]
