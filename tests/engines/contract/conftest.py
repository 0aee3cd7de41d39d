"""The replica contract runs against every engine driver installed here: vLLM, the
module replica and the engine written from docs/engines.md ("minimal") in the vLLM
environment, SGLang in the SGLang environment. Engines start once per module and
engine, one engine kind at a time (2-core machines)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from enginehooks_testkit.engines import DRIVERS, RunningEngine, register_driver, start_engine
from tests.support import have

if have("transformers"):  # the engine of docs/engines.md, run from the page
    from tests.support.engine_page import MinimalEngine

    register_driver(MinimalEngine)

#: engine -> the module it needs
NEEDS = {"vllm": "vllm", "sglang": "sglang", "local": "transformers",
         "minimal": "transformers"}


@pytest.fixture(scope="module", params=sorted(DRIVERS))
def engine(request: pytest.FixtureRequest) -> str:
    name = request.param
    if not have(NEEDS[name]):
        pytest.skip(f"{name} runs in its own environment (scripts/test.sh runs it there)")
    return name


@pytest.fixture(scope="module")
def replicas(engine: str, model_dirs: dict[str, Path]) -> Iterator[dict[str, RunningEngine]]:
    """One running engine per tiny model (llama, qwen2 tied)."""
    started: dict[str, RunningEngine] = {}
    try:
        for arch, path in model_dirs.items():
            started[arch] = start_engine(engine, path)
        yield started
    finally:
        for r in started.values():
            r.close()
