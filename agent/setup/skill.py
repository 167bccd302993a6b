"""Install the coding-agent skill, so Claude Code or Codex can drive nightshift as the planner.

    claude: <project>/.claude/skills/nightshift/SKILL.md   (--user: ~/.claude/skills/nightshift/SKILL.md)
    codex:  a `## nightshift` section in <project>/AGENTS.md (--user: ~/.codex/AGENTS.md), between
            markers, so installing again replaces the section instead of adding a second one.

The texts ship inside the package (`agent/skill_files/`, package data).
"""

from __future__ import annotations

import re
from pathlib import Path

TARGETS = ("claude", "codex")
START = "<!-- nightshift:start -->"
END = "<!-- nightshift:end -->"
_SECTION = re.compile(re.escape(START) + r".*?" + re.escape(END) + r"\n?", re.S)


class SkillError(Exception):
    """Cannot install where asked (unknown target, missing project folder): one line for the user."""


def skill_text(name: str) -> str:
    """`SKILL.md` (Claude Code) or `AGENTS.md` (the Codex section), as shipped."""
    return (Path(__file__).resolve().parent.parent / "skill_files" / name).read_text(encoding="utf-8")


def install(target: str, project_dir: Path, home: Path, user: bool = False) -> list[Path]:
    """Install the skill for `target` ("claude" or "codex") into the project (or, with `user`,
    into `home`). Returns the files written; installing twice leaves the same files."""
    if target not in TARGETS:
        raise SkillError(f"unknown target {target!r}: choose claude or codex")
    base = (Path(home) if user else Path(project_dir)).resolve()
    if not base.is_dir():
        raise SkillError(f"{base}: no such directory")
    if target == "claude":
        path = base / ".claude" / "skills" / "nightshift" / "SKILL.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(skill_text("SKILL.md"), encoding="utf-8")
        return [path]
    path = base / ".codex" / "AGENTS.md" if user else base / "AGENTS.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(merge_section(path.read_text(encoding="utf-8") if path.is_file() else "",
                                  skill_text("AGENTS.md")), encoding="utf-8")
    return [path]


def merge_section(existing: str, section: str) -> str:
    """`existing` with the nightshift section replaced (or appended, when it has none)."""
    block = f"{START}\n{section.strip()}\n{END}\n"
    if _SECTION.search(existing):
        return _SECTION.sub(lambda _: block, existing, count=1)
    if not existing.strip():
        return block
    return existing.rstrip("\n") + "\n\n" + block
