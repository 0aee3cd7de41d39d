"""vLLM-specific fixtures: a real vLLM OpenAI server with the worker extension (see
shared/reference/engines-on-cpu.md for how vLLM runs on CPU)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from enginehooks_testkit.engines import NEW_TOKENS, PROMPTS
from enginehooks_testkit.servers import VLLMServerProcess as _VLLMServer
from tests.support import have

if not have("vllm"):
    pytest.skip("vLLM runs in its own environment (scripts/test.sh runs this there)",
                allow_module_level=True)

# vLLM finds backend "enginehooks" through the `vllm.general_plugins` entry point; make
# this checkout's declaration visible before any engine of the session loads plugins.
from tests.support.entry_points import expose_entry_points

expose_entry_points("vllm.general_plugins")


class VLLMServerProcess(_VLLMServer):
    """The library's launcher, answering with the test prompts."""

    def greedy(self, prompts: list[list[int]] = PROMPTS,  # type: ignore[override]
               max_tokens: int = NEW_TOKENS) -> list[list[int]]:
        return super().greedy(prompts, max_tokens)


@pytest.fixture(scope="session")
def vllm_server(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[VLLMServerProcess]:
    from enginehooks.core.auth import SECRET_ENV

    log = tmp_path_factory.mktemp("logs") / "vllm.log"
    # An open server (no secret, whatever the caller's environment holds): the handles of
    # its users carry none, and tests/vllm/security/test_server_open.py shares it.
    env = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, "ENGINEHOOKS_SECRET_FILE")}
    # The worker extension (the launcher's) and backend "enginehooks" of vLLM's own
    # weight-transfer routes, as the README's quick start starts it.
    backend = ["--weight-transfer-config", '{"backend": "enginehooks"}']
    with VLLMServerProcess(model_dirs["llama"], log, env=env, extra_args=backend) as srv:
        yield srv
