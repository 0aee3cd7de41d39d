"""Helpers of the SGLang suites: launchers answering with the test prompts, and the
vLLM environment's interpreter for the mixed-fleet test."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from enginehooks_testkit.engines import NEW_TOKENS, PROMPTS
from enginehooks_testkit.servers import SGLangServerProcess as _SGLangServer
from enginehooks_testkit.servers import VLLMServerProcess as _VLLMServer

# scripts/test.sh exports the vLLM environment's interpreter (built by setup-vllm-env.sh).
VLLM_PYTHON = Path(os.environ.get(
    "ENGINEHOOKS_VLLM_PYTHON",
    Path(os.environ.get("ENGINEHOOKS_CACHE", Path.home() / ".cache" / "enginehooks"))
    / "venv-vllm" / "bin" / "python"))


def hf_reference(model: Any) -> list[list[int]]:
    from enginehooks_testkit.tiny import hf_greedy

    return hf_greedy(model, PROMPTS, NEW_TOKENS)


class SGLangServerProcess(_SGLangServer):
    """The library's launcher, answering with the test prompts (and served versions)."""

    def generate(self, prompts: list[list[int]] = PROMPTS,  # type: ignore[override]
                 max_tokens: int = NEW_TOKENS) -> list[dict[str, Any]]:
        return super().generate(prompts, max_tokens)

    def greedy(self) -> tuple[list[list[int]], set[str]]:  # type: ignore[override]
        outs = self.generate()
        return [o["output_ids"] for o in outs], {o["meta_info"]["weight_version"] for o in outs}


class VLLMServerProcess(_VLLMServer):
    """A real vLLM server from the vLLM environment (vLLM and SGLang pin different torch
    builds and cannot share one), with the enginehooks worker extension, in dev mode."""

    def __init__(self, model: Path, log: Path) -> None:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SGLANG_", "PYTHONPATH", "VIRTUAL_ENV"))}
        env.update(HF_HUB_OFFLINE="1",
                   PATH=f"{VLLM_PYTHON.parent}{os.pathsep}{os.environ.get('PATH', '')}")
        super().__init__(model, log, python=str(VLLM_PYTHON), env=env)

    def greedy(self) -> list[list[int]]:  # type: ignore[override]
        return super().greedy(PROMPTS, NEW_TOKENS)
