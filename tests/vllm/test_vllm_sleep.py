"""Colocated memory choreography on the real vLLM server: `WeightSync(wake_up=True)`
wakes the weights of a sleeping engine after the check, updates them, flushes, then
wakes the KV cache, which lets the engine schedule again.

What this can test on CPU: vLLM's engine-level sleep state (`/is_sleeping`, scheduling
paused while any tag sleeps) and the order of the calls; vLLM's CPU worker accepts
`sleep`/`wake_up` and moves no memory. That GPU memory is really released and restored
around a push is untested here (no vLLM GPU build exists on our GPU machines), as is
SGLang's `release_memory_occupation`, which ends a CPU server (it synchronises CUDA).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from enginehooks import ConfigError, WeightSync
from enginehooks.vllm_ext import VLLMServer
from enginehooks_testkit.engines import NEW_TOKENS, PROMPTS
from enginehooks_testkit.generation import first_difference
from enginehooks_testkit.tiny import hf_greedy, load_tiny, perturb
from tests.support import requires_vllm

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]


def test_a_push_wakes_a_sleeping_engine_weights_first_kv_cache_last(
        vllm_server: Any, model_dirs: dict[str, Path]) -> None:
    h = VLLMServer(vllm_server.url, name="sleepy")
    h.sleep(1, timeout_s=60)
    try:
        assert h.is_sleeping(30) is True
        model = perturb(load_tiny(model_dirs["llama"]), seed=71)
        with WeightSync("gloo", bucket_bytes=32 << 10, timeout_s=60, wake_up=True) as sync:
            sync.add_replica(h)
            report = sync.push(model, version="awake-71")
        order = [p for p in report.phases if p in
                 ("check", "wake_weights", "transfer", "finish", "wake_kv_cache")]
        assert order == ["check", "wake_weights", "transfer", "finish", "wake_kv_cache"]
        assert h.is_sleeping(30) is False  # fully awake: vLLM schedules again
    finally:
        if h.is_sleeping(30):
            h.wake_up(["weights", "kv_cache"], timeout_s=60)
    gens = vllm_server.generations()
    assert [list(g.tokens) for g in gens] == hf_greedy(model, PROMPTS, NEW_TOKENS)
    assert {g.version for g in gens} == {"awake-71"}


def test_wake_up_refuses_an_awake_engine_before_anything_moves(
        vllm_server: Any, model_dirs: dict[str, Path]) -> None:
    h = VLLMServer(vllm_server.url, name="awake")
    assert h.is_sleeping(30) is False
    version, before = h.version(), vllm_server.generations()
    with WeightSync("gloo", timeout_s=60, wake_up=True) as sync:
        sync.add_replica(h)
        with pytest.raises(ConfigError, match="is awake"):
            sync.push(perturb(load_tiny(model_dirs["llama"]), seed=72), version="never")
    assert h.version() == version
    assert first_difference(vllm_server.generations(), before) is None
