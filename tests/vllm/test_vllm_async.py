"""Push into a real `AsyncLLM` (its engine core runs in its own process) through the
`VLLMAsyncEngine` handle, which schedules calls onto the engine's event loop."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enginehooks import WeightSync
from enginehooks.vllm_ext import VLLMAsyncEngine
from enginehooks_testkit.engines import NEW_TOKENS, PROMPTS
from enginehooks_testkit.tiny import hf_greedy, perturb
from enginehooks_testkit.tiny import load_tiny as load_hf
from tests.support import requires_vllm

EXTENSION = "enginehooks.vllm_ext.WorkerExtension"

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]
_ids = itertools.count()


@pytest.fixture(scope="module")
def async_engine(model_dirs: dict[str, Path]) -> Iterator[tuple[Any, asyncio.AbstractEventLoop]]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def make() -> Any:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=str(model_dirs["llama"]), dtype="float32", max_model_len=256,
            enforce_eager=True, worker_extension_cls=EXTENSION))

    engine = asyncio.run_coroutine_threadsafe(make(), loop).result(timeout=240)
    try:
        yield engine, loop
    finally:
        engine.shutdown()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def async_greedy(engine: Any, loop: asyncio.AbstractEventLoop) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    async def run() -> list[list[int]]:
        outs = []
        for p in PROMPTS:
            last = None
            sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            async for o in engine.generate(TokensPrompt(prompt_token_ids=p), sp,
                                           request_id=f"req-{next(_ids)}"):
                last = o
            outs.append(list(last.outputs[0].token_ids))
        return outs

    return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout=60)


def test_push_into_async_llm_matches_hf(async_engine: Any, model_dirs: dict[str, Path]) -> None:
    engine, loop = async_engine
    model = perturb(load_hf(model_dirs["llama"]), seed=71)
    handle = VLLMAsyncEngine(engine, loop)
    with WeightSync("gloo", timeout_s=60, pause=True, bucket_bytes=32 << 10) as sync:
        sync.add_replica(handle)
        report = sync.push(model, version=3)
    assert report.ok and report.buckets > 1
    assert async_greedy(engine, loop) == hf_greedy(model, PROMPTS, NEW_TOKENS)
    assert handle.version() == 3
