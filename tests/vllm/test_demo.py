"""The README's first command, `make demo`, run as its recipe runs it: the Makefile's
`demo` line is `scripts/run.sh vllm python -m enginehooks.cli demo`, and the test runs
`python -m enginehooks.cli demo` in this (the vLLM) environment, which `scripts/run.sh
vllm` would pick, so the environment setup is not repeated inside the suite. The demo
starts a real vLLM server on a tiny Llama, trains it and pushes the result over gloo;
the test asserts what the demo shows: the push changed generation, the engine's greedy
tokens equal HF transformers' on the new weights, and the engine holds version 1."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import requires_vllm

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RUN_SH = "bash scripts/run.sh vllm "


def demo_recipe() -> str:
    """The command of the Makefile's `demo` target."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = lines.index("demo:")
    recipe = lines[start + 1].strip().lstrip("@")
    assert recipe.startswith(RUN_SH), recipe
    return recipe[len(RUN_SH):]


def test_the_readme_points_at_make_demo() -> None:
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"^make demo\b", readme, re.M), "the README's first command moved"
    assert demo_recipe() == "python -m enginehooks.cli demo"


def test_make_demo_pushes_trained_weights_that_equal_hf(tmp_path: Path) -> None:
    argv = demo_recipe().split()
    assert argv[0] == "python"
    cmd = [sys.executable, *argv[1:], "--workdir", str(tmp_path)]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    out = proc.stdout
    assert proc.returncode == 0, f"demo exited {proc.returncode}:\n{out}\n{proc.stderr[-4000:]}"
    # What the demo shows: generation before and after the push, per prompt ...
    before = [ast.literal_eval(s) for s in re.findall(r"before push: (\[.*\])", out)]
    after = [ast.literal_eval(s) for s in re.findall(r"after push:  (\[.*\])", out)]
    assert len(before) == len(after) > 0, out
    assert before != after, "the push did not change what the engine generates"
    # ... held-out prompts where the engine and HF transformers agree token for token ...
    engine = [ast.literal_eval(s) for s in re.findall(r"vLLM after push: (\[.*\])", out)]
    hf = [ast.literal_eval(s) for s in re.findall(r"HF transformers: (\[.*\])", out)]
    assert engine == hf and len(hf) > 0, out
    # ... the version it holds, and its verdict.
    assert "[demo] engine reports weight version 1" in out, out
    assert re.search(r"vLLM greedy after push == HF transformers on the new weights "
                     r"\(\d+ prompts\): True", out), out
    assert "MISMATCH" not in out
    assert (tmp_path / "model" / "config.json").exists()
