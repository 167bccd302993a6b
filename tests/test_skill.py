"""The coding-agent skill: it installs where Claude Code and Codex look for it, and following
SKILL.md step by step gets from a model file to a verified, timed candidate with no step missing."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent.setup.skill import END, START, install, skill_text

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "models" / "tiny_rmsnorm.py"
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
def test_following_skill_md_gets_a_verified_timed_candidate(tmp_path):
    work, bin_dir = tmp_path / "work", tmp_path / "bin"
    work.mkdir()
    bin_dir.mkdir()
    shutil.copy(TINY, work / "model.py")
    # The `agent` command, in case the console script is not installed: `python -m agent`.
    shim = bin_dir / "agent"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m agent "$@"\n')
    shim.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}

    # The candidate, written as SKILL.md's own example; the variant is a new source to drop in the inbox.
    (example,) = [b for b in fenced(SKILL, "python") if "def forward(module" in b]
    (work / "rmsnorm_candidate.py").write_text(example)
    (work / "rmsnorm_variant.py").write_text(example + "\n# variant 2, for the inbox\n")
    values = {"<model.py>": "model.py", "<candidate.py>": "rmsnorm_candidate.py",
              "<variant.py>": "rmsnorm_variant.py", "<Region>": "RMSNorm"}

    steps, verdict, run = [], None, None
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
                                    timeout=180)
            # SKILL.md: "Every command below exits 0 on success".
            assert result.returncode == 0, (line, result.returncode, result.stdout[:2000], result.stderr[-2000:])
            assert "Traceback" not in result.stderr, (line, result.stderr[-3000:])
            words = line.split()
            step = " ".join(words[:2]) if words[0] == "agent" else words[0]
            steps.append(step)

            if step == "agent doctor":
                assert json.loads(result.stdout)["ok"] is True
            elif step == "agent profile":
                data = json.loads(result.stdout)
                assert "RMSNorm" in data["problems"], data["skipped"]
                run = data["run"]  # the `<run>` of every later step
                values["<run>"] = run
                assert (work / run / "run.json").is_file()
                hot = json.loads((work / run / "hotspots.json").read_text())
                row = next(r for r in hot["by_class"] if r["class_name"] == "RMSNorm")
                for field in ("share", "inclusive_ms", "top_kernels", "small_kernels", "floor_ms", "achieved"):
                    assert field in row, f"SKILL.md names hotspots field {field}"
            elif step == "cat":
                problem = json.loads(result.stdout)
                for field in ("region_source", "workloads", "tolerance", "parameters", "attributes", "children",
                              "floor_ms", "share_of_model", "top_kernels"):
                    assert field in problem, f"SKILL.md names problem.json field {field}"
                (workload,) = problem["workloads"]
                assert {"inputs", "outputs", "weight", "baseline_ms"} <= workload.keys()
                assert {"shape", "dtype", "stride"} <= workload["outputs"][0].keys()
            elif step == "agent try":
                verdict = json.loads(result.stdout)
                for field in ("status", "reason", "error_text", "error", "tolerance", "max_abs", "max_rel",
                              "fresh_error", "timings", "speedup", "flags"):
                    assert field in verdict, f"SKILL.md names verdict field {field}"
            elif step == "agent tune":
                summary = json.loads(result.stdout)
                assert summary["stop_reason"] == "planners have nothing new to try"
                assert summary["stop_reason"] in SKILL
                assert summary["trials"] == 1 and summary["timing_kind"] == "cpu"  # the variant; the candidate was tried
            elif step == "agent status":
                (row,) = json.loads(result.stdout)["regions"]
                assert row["region"] == "RMSNorm" and row["trials"] == 2 and row["passing"] == 2, row
                for field in ("best_speedup", "best_by_generation", "best_error", "tolerance", "failures"):
                    assert field in row, f"SKILL.md names status field {field}"
            elif step == "agent report":
                assert (work / run / "report.md").is_file()

    # No step missing, in the order the workflow needs them.
    order = ["agent doctor", "agent profile", "cat", "agent try", "mkdir", "cp", "agent tune", "agent status",
             "agent report"]
    assert [s for s in steps if s in order] == sorted((s for s in steps if s in order), key=order.index)
    assert set(order) <= set(steps), steps

    # The end state: a verified, timed candidate (CPU timings here, and labelled so).
    assert verdict["status"] == "ok", (verdict["status"], verdict["reason"], verdict["error_text"][-2000:])
    assert verdict["error"] <= float(verdict["tolerance"].split()[1]) and verdict["speedup"] > 0
    assert verdict["timings"] and all(t["timing_kind"] == "cpu" and t["candidate_ms"] > 0 for t in verdict["timings"])
    assert (work / verdict["candidate_path"]).read_text() == example
    assert "RMSNorm" in (work / run / "report.md").read_text()
