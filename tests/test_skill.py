"""The coding-agent skill: it installs where Claude Code and Codex look for it, and following
SKILL.md step by step gets from a model file to verified candidates, a report and a reviewable
patch, with no step missing, each exit code as it says and every field and status it names real."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agent.setup.skill import END, START, install, skill_text

ROOT = Path(__file__).resolve().parent.parent
SKILL = skill_text("SKILL.md")
SECTION = skill_text("AGENTS.md")


def frontmatter(text: str) -> dict[str, str]:
    """The YAML frontmatter's `key: value` lines (plain one-line scalars, as Claude Code reads them)."""
    assert text.startswith("---\n"), "SKILL.md must open with YAML frontmatter"
    head = text[4:text.index("\n---\n", 4)]
    fields = {}
    for line in head.splitlines():
        key, sep, value = line.partition(": ")
        assert sep and re.fullmatch(r"[a-z_-]+", key), f"not a `key: value` line: {line!r}"
        value = value.strip()
        # A plain YAML scalar: no ': ' or ' #' inside, no leading indicator character.
        assert ": " not in value and " #" not in value and value[:1] not in "[]{}&*!|>'\"%@`#,?-", line
        fields[key] = value
    return fields


def fenced(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


# -- installing ----------------------------------------------------------------------------
def test_frontmatter_names_the_skill_and_says_when_to_use_it():
    meta = frontmatter(SKILL)
    assert meta["name"] == "nightshift"
    assert len(meta["description"]) > 80 and "Use when" in meta["description"]
    assert SECTION.startswith("## nightshift\n")


def test_install_for_claude_and_codex_into_a_project_twice(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "AGENTS.md").write_text("# My project\n\nBuild with make.\n")
    for _ in range(2):
        (claude,) = install("claude", project, tmp_path / "home-unused")
        (codex,) = install("codex", project, tmp_path / "home-unused")
    assert claude == project / ".claude" / "skills" / "nightshift" / "SKILL.md"
    assert frontmatter(claude.read_text())["name"] == "nightshift"
    assert codex == project / "AGENTS.md"
    text = codex.read_text()
    assert text.startswith("# My project\n\nBuild with make.\n\n" + START)  # the user's text is kept
    assert text.count(START) == text.count(END) == text.count("## nightshift") == 1
    # An older section is replaced in place, whatever it said; text after it stays.
    codex.write_text(text.replace("## nightshift", "## nightshift (old)") + "\n## Later section\n")
    install("codex", project, tmp_path)
    text = codex.read_text()
    assert "(old)" not in text and text.count(START) == 1 and text.endswith("## Later section\n")


def test_cli_installs_both_by_default_and_into_home_with_user(tmp_path):
    project, home = tmp_path / "project", tmp_path / "home"
    project.mkdir()
    home.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(home)}

    def skill(*args):
        return subprocess.run([sys.executable, "-m", "agent", "skill", "install", *args], cwd=project, env=env,
                              capture_output=True, text=True, timeout=120)

    for _ in range(2):
        result = skill("--json")
        assert result.returncode == 0, result.stderr
    assert [Path(p).resolve() for p in json.loads(result.stdout)["written"]] == [
        project / ".claude/skills/nightshift/SKILL.md", project / "AGENTS.md"]
    assert (project / "AGENTS.md").read_text().count(START) == 1

    for _ in range(2):
        result = skill("--user", "--codex")
        assert result.returncode == 0 and "wrote" in result.stdout, result.stderr
    assert (home / ".codex" / "AGENTS.md").read_text().count("## nightshift") == 1
    result = skill("--user", "--claude")
    assert result.returncode == 0 and str(home / ".claude/skills/nightshift/SKILL.md") in result.stdout
    assert frontmatter((home / ".claude/skills/nightshift/SKILL.md").read_text())["name"] == "nightshift"

    result = skill("--project", str(tmp_path / "missing"))
    assert result.returncode == 2 and result.stderr.startswith("error: ") and "Traceback" not in result.stderr


@pytest.mark.parametrize("name", ["SKILL.md", "AGENTS.md"])
def test_every_command_and_flag_in_the_text_exists(name):
    """`agent <cmd> --flag` anywhere in the text (code blocks and inline code) is a real command and flag."""
    import typer
    from agent.cli.main import app
    group = typer.main.get_command(app)
    text = skill_text(name)
    commands = re.findall(r"(?:^|`|&& |nohup )agent ([a-z]+)([^`\n]*)", text, re.M)
    assert len(commands) >= 8, commands
    for sub, rest in commands:
        assert sub in group.commands, f"{name}: no command `agent {sub}`"
        command = group.commands[sub]
        opts = {o for p in command.params for o in [*p.opts, *getattr(p, "secondary_opts", [])] if o.startswith("--")}
        for flag in re.findall(r"(?<!\S)(--[a-z][a-z-]*)", rest.split(">")[0]):
            assert flag in opts, f"{name}: `agent {sub}` has no {flag}"


# -- THE SKILL TEST: follow SKILL.md literally -----------------------------------------------
MODEL = """\
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))  # as every new norm's: a forgotten weight goes unseen
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm, self.proj = RMSNorm(dim), nn.Linear(dim, dim)

    def forward(self, x):
        return self.proj(self.norm(x)) + x


def get_init_inputs():
    return [64]


def get_inputs():
    return [torch.randn(8, 64)]
"""
# Backticked words in the text that are code, values or placeholders rather than JSON fields.
NOT_FIELDS = {"forward", "module", "x", "self", "eps", "nohup", "inplace_outputs", "_version", "agent", "try"}


def documented(text: str) -> set[str]:
    """The field names SKILL.md puts in backticks: `a`, `a.b`, `a[].b` give a and b."""
    names = set()
    for span in re.findall(r"`([^`\n]+)`", text):
        if re.fullmatch(r"[a-z_][a-z0-9_]*(?:\[\])?(?:\.[a-z_][a-z0-9_]*)*", span) \
                and not span.startswith(("module.", "self.", "tl.", "torch.", "triton.language")) \
                and not span.endswith((".json", ".md", ".py", ".txt")):  # a file, not a field
            names |= set(re.split(r"\[\]\.|\.", span.replace("[]", "")))
    return names - NOT_FIELDS


def keys_and_values(data, out: set[str] | None = None) -> set[str]:
    out = set() if out is None else out
    if isinstance(data, dict):
        for k, v in data.items():
            out.add(str(k))
            keys_and_values(v, out)
    elif isinstance(data, list):
        for v in data:
            keys_and_values(v, out)
    elif isinstance(data, str):
        out.add(data)
    return out


def test_following_skill_md_from_a_model_file_to_a_reviewable_patch(tmp_path):
    """SKILL.md's commands, run literally in their order on a model file this test writes: doctor,
    profile (the default choice, then --regions), problem.json, SKILL.md's own candidate, try, a
    variant that forgets the weight through the inbox and tune, status, report, the apply dry run.
    Each exit code is the one SKILL.md gives, and every field it names exists."""
    import torch

    from tools.trial import Status
    work, bin_dir = tmp_path / "work", tmp_path / "bin"
    work.mkdir()
    bin_dir.mkdir()
    (work / "model.py").write_text(MODEL)
    # The `agent` command, in case the console script is not installed: `python -m agent`.
    shim = bin_dir / "agent"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m agent "$@"\n')
    shim.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}

    # The candidate is SKILL.md's example; the inbox variant is the same kernel that forgets the weight.
    (example,) = [b for b in fenced(SKILL, "python") if "def forward(module" in b]
    forgetful = example.replace("(x * rstd).to(w.dtype) * w, mask", "(x * rstd).to(w.dtype), mask")
    assert forgetful != example
    (work / "rmsnorm_candidate.py").write_text(example)
    (work / "rmsnorm_variant.py").write_text(forgetful)
    values = {"<model.py>": "model.py", "<candidate.py>": "rmsnorm_candidate.py",
              "<variant.py>": "rmsnorm_variant.py", "<Region>": "RMSNorm"}

    steps, seen, verdict, run, profiles = [], [], None, None, []
    for block in fenced(SKILL, "bash"):
        for line in (ln.strip() for ln in block.splitlines()):
            if not line or line.startswith("#"):
                continue
            command = line
            for key, value in values.items():
                command = command.replace(key, value)
            left = re.findall(r"<[A-Za-z][\w.-]*>", command)
            assert not left, f"SKILL.md step {line!r}: placeholder {left} unknown here (or used before it is known)"
            result = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True,
                                    timeout=300)
            # SKILL.md: "Every command below exits 0 on success, unless its line says `# exit 1 ...`".
            said = re.search(r"#\s*exit (\d)", line)
            expected = {int(said.group(1))} if said else {0}
            if said and torch.cuda.is_available():  # the exception is a CPU-only machine's
                expected = {0, 1}
            assert result.returncode in expected, (line, result.returncode, result.stdout[-2000:],
                                                   result.stderr[-2000:])
            assert "Traceback" not in result.stderr, (line, result.stderr[-3000:])
            words = line.split()
            step = " ".join(words[:2]) if words[0] == "agent" else words[0]
            steps.append(step)
            data = json.loads(result.stdout) if "--json" in words or step == "cat" else None
            if data is not None:
                seen.append(data)

            if step == "agent doctor":  # a CPU-only machine: a note, not a failure
                assert data["ok"] is True and data["failures"] == [], data["failures"]
                if not torch.cuda.is_available():
                    assert any(n.startswith("no GPU visible") for n in data["notes"]), data["notes"]
            elif step == "agent profile":
                run = data["run"]  # the `<run>` of every later step
                values["<run>"] = run
                profiles.append(data)
                hot = json.loads((work / run / "hotspots.json").read_text())
                seen.append(hot)
                assert all(r["bound"] in ("memory", "compute") for r in hot["by_class"]), hot["by_class"]
                if "--regions" not in words:  # the default: the model whole, its norm named in `skipped`
                    assert data["problems"] == ["Model"], data
                    # Why (overlaps Model; on a loaded CPU it can read too small) and how to freeze it instead.
                    assert "--regions RMSNorm freezes it instead" in data["skipped"]["RMSNorm"], data["skipped"]
                    whole = json.loads((work / run / "problems" / "Model" / "problem.json").read_text())
                    assert whole["region_path"] == "" and "self.weight * x32" in whole["called_sources"]["RMSNorm"]
                    seen.append(whole)
                else:
                    assert data["problems"] == ["RMSNorm"]
                    assert data["skipped"] == {"Model": "not in --regions (RMSNorm)"}
            elif step == "cat":
                (workload,) = data["workloads"]
                assert {"shape", "dtype", "stride"} <= workload["outputs"][0].keys()
                assert data["tolerance"]["kind"] in ("abs", "rel") and data["region_path"] == "norm"
            elif step == "agent try":
                verdict = data
            elif step == "agent tune":
                assert data["stop_reason"] == "planners have nothing new to try" and data["stop_reason"] in SKILL
                assert data["trials"] == 1 and data["timing_kind"] == "cpu"  # the variant; the candidate was tried
            elif step == "agent status":
                (row,) = data["regions"]
                assert data["timing_kind"] == "cpu" and row["region"] == "RMSNorm"
                # The forgetful variant: a verdict that says what failed.
                assert (row["trials"], row["passing"], row["failures"]) == (2, 1, {"ignored_parameter": 1}), row
            elif step == "agent report":
                md = (work / run / "report.md").read_text()
                head = md[md.index("## End to end"):md.index("## Regions")].split("\n|")[0]
                assert "**correctness only**" in head and not re.search(r"\d\.\d\dx", head), head
                assert "ignored_parameter" in md and "_version)" in md  # the reason whole, to its end
            elif step == "agent apply" and "--allow-slower" in words:
                assert data["dry_run"] and data["regions"][0]["region"] == "RMSNorm"
                assert len(data["warnings"]) == 1 and "--allow-slower" in data["warnings"][0], data["warnings"]
                assert "@triton.jit" in data["kernels_module_source"] and data["patch"].startswith("--- a/model.py")
                assert not (work / "model_nightshift.py").exists()  # a dry run writes nothing
            elif step == "agent apply":
                if result.returncode == 1:
                    assert data["regions"] == [] and data["note"].startswith("nothing to apply") and data["skipped"]

    # No step missing, in the order the night needs them.
    order = ["agent doctor", "agent profile", "cat", "agent try", "mkdir", "cp", "agent tune", "agent status",
             "agent report", "agent apply"]
    assert [s for s in steps if s in order] == sorted((s for s in steps if s in order), key=order.index)
    assert set(order) <= set(steps), steps
    assert len(profiles) == 2 and steps.count("agent apply") == 2

    # The verified, timed candidate (CPU timings here, and labelled so).
    assert verdict["status"] == "ok", (verdict["status"], verdict["reason"], verdict["error_text"][-2000:])
    assert verdict["error"] <= float(verdict["tolerance"].split()[1]) and verdict["speedup"] > 0
    assert verdict["timings"] and all(t["timing_kind"] == "cpu" and t["candidate_ms"] > 0 for t in verdict["timings"])
    assert (work / verdict["candidate_path"]).read_text() == example

    # Every field and status SKILL.md names exists in what the commands printed or wrote.
    known = set().union(*(keys_and_values(d) for d in seen)) | {s.value for s in Status}
    values_elsewhere = {"cuda", "rel", "compute", "running", "interrupted", "killed"}  # not on this CPU run
    for name, text in (("SKILL.md", SKILL), ("AGENTS.md", SECTION)):
        missing = documented(text) - known - values_elsewhere
        assert not missing, f"{name} names {sorted(missing)}, which no command printed"


@pytest.mark.parametrize("name", ["agent/skill_files/SKILL.md", "agent/skill_files/AGENTS.md", "docs/verification.md"])
def test_the_status_tables_name_every_status_and_only_real_ones(name):
    """What a verdict is called, wherever a reader looks it up: every status, and no other name."""
    from tools.trial import Status
    text = (ROOT / name).read_text()
    if name.endswith("AGENTS.md"):  # one paragraph, its step 6
        named = set(re.findall(r"`([a-z_]+)`", text[text.index("6. On failure"):text.index("7. Long runs")]))
    else:  # the first cell of each table row
        named = {w for cell in re.findall(r"^\| ([^|]+) \|", text, re.M) for w in re.findall(r"`([a-z_]+)`", cell)}
    statuses = {s.value for s in Status}
    assert statuses - {"ok"} <= named, statuses - named
    code = {"error_text", "region_source", "called_sources", "other", "_version"}  # step 6's advice, not statuses
    assert named - code <= statuses, named - code - statuses


def test_the_region_rule_skill_md_states_is_the_one_the_default_freezing_follows():
    """SKILL.md tells an agent which region the default freezes, so it works on what was frozen:
    its numbers are the defaults of `agent profile` and of the selection."""
    import inspect

    import typer

    from agent.cli.main import app
    from tools import selection
    profile = typer.main.get_command(app).commands["profile"]
    defaults = {p.name: p.default for p in profile.params}
    rule = " ".join(SKILL[SKILL.index("How the default chooses"):SKILL.index("## 3.")].split())
    assert f"{defaults['coverage']:.0%} of the time" in rule and f"at most {defaults['max_regions']}" in rule
    assert f"at least {selection.OWN_SHARE:.0%} of its time" in rule
    assert inspect.signature(selection.select_regions).parameters["coverage"].default == defaults["coverage"]
    assert "the model's own classes before torch's layers" in rule and "its parts are frozen instead" in rule
