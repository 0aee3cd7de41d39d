"""What an update makes stale in a real vLLM engine is dropped, and an update may leave
whole modules out (issue 39 items 1 and 3). One in-process engine (a 2-3 s start) serves
the module.

Caches (read in vLLM 0.32's source; `vllm_ext/handles.py` lists them): the prefix cache
and the encoder cache (vision embeddings, held by the scheduler's `EncoderCacheManager`
and the model runner's `encoder_cache`) are reset by every push. No vision-language
model runs in this vLLM environment (vLLM's VLM modules import torchvision, which it
lacks), so the encoder cache is observed through vLLM's own objects in the real engine:
entries put there before a push are gone after it.

Partial updates: a push with `keep=[...]` leaves whole modules out; generation then
equals HF transformers on the trainer's weights with the kept modules as the engine held
them (the fresh-load answer of those weights), the push is verified against vLLM's
fresh-load path on the modules it sent, and a module sent in part is refused before any
byte moves, the engine unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from enginehooks import WeightSync
from enginehooks.core.errors import ManifestError
from enginehooks_testkit.engines import NEW_TOKENS, PROMPTS, VLLMInProcess
from enginehooks_testkit.tiny import hf_greedy, load_tiny, perturb

pytestmark = [pytest.mark.vllm]

MISSING = "missing from the update (engines reload whole layers)"


@pytest.fixture(scope="module")
def engine(model_dirs: dict[str, Path]) -> Iterator[VLLMInProcess]:
    running = VLLMInProcess(model_dirs["llama"])
    try:
        yield running
    finally:
        running.close()


def _core(engine: VLLMInProcess) -> Any:
    return engine.llm.llm_engine.engine_core.engine_core  # in-process EngineCore


def _runner(engine: VLLMInProcess) -> Any:
    return engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner


def _greedy(engine: VLLMInProcess) -> list[list[int]]:
    return [list(g.tokens) for g in engine.generate(PROMPTS, NEW_TOKENS)]


def _push(engine: VLLMInProcess, model: Any, version: str, **kw: Any) -> Any:
    with WeightSync("gloo", bucket_bytes=32 << 10, timeout_s=120, verify=True) as sync:
        sync.add_replica(engine.handle("vllm-caches"))
        return sync.push(model, version=version, **kw)


def test_a_push_drops_the_encoder_and_prefix_caches(engine: VLLMInProcess,
                                                    model_dirs: dict[str, Path]) -> None:
    core, runner = _core(engine), _runner(engine)
    manager = core.scheduler.encoder_cache_manager
    # a cached prefix: a prompt of full blocks generated once stays in the prefix cache
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    long = [4 + i % 250 for i in range(250)]
    engine.llm.generate([TokensPrompt(prompt_token_ids=long)], SamplingParams(max_tokens=1),
                        use_tqdm=False)
    pool = core.scheduler.kv_cache_manager.block_pool
    assert len(pool.cached_block_hash_to_block) > 0
    # encoder outputs of an image, as the scheduler and the model runner keep them
    manager.cached["image-hash"] = set()
    manager.num_embeds_by_hash["image-hash"] = 4
    manager.freeable["image-hash"] = 4
    runner.encoder_cache["image-hash"] = torch.ones(4, 64)

    _push(engine, perturb(load_tiny(model_dirs["llama"]), seed=301), "caches-1")

    assert manager.cached == {} and manager.num_embeds_by_hash == {}
    assert manager.num_free_slots == manager.cache_size
    assert "image-hash" not in runner.encoder_cache
    assert len(pool.cached_block_hash_to_block) == 0


def test_a_push_with_requests_in_flight_still_drops_every_old_prefix(
        engine: VLLMInProcess, model_dirs: dict[str, Path]) -> None:
    """vLLM resets its prefix cache only while no request holds a block, and says so
    with a False it is easy to drop: a push made while requests run (no `pause`, or
    `pause_mode="keep"`) left every old-weight prefix cached. The flush now asks again
    with vLLM's `reset_running_requests`: the request in flight is preempted and
    recomputed with the new weights, and nothing of the old weights stays cached."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    core = _core(engine)
    pool = core.scheduler.kv_cache_manager.block_pool
    llm_engine = engine.llm.llm_engine
    long = [4 + i % 250 for i in range(250)]
    engine.llm.generate([TokensPrompt(prompt_token_ids=long)], SamplingParams(max_tokens=1),
                        use_tqdm=False)
    assert len(pool.cached_block_hash_to_block) > 0  # an old-weight prefix, cached
    # a request in flight: added and stepped, it holds KV blocks while the push runs
    llm_engine.add_request("in-flight", TokensPrompt(prompt_token_ids=long[:64]),
                           SamplingParams(max_tokens=40, ignore_eos=True))
    llm_engine.step()
    assert core.scheduler.running
    assert core.scheduler.reset_prefix_cache() is False  # what a plain reset answers now

    new = perturb(load_tiny(model_dirs["llama"]), seed=331)
    report = _push(engine, new, "in-flight-1")
    assert report.ok, report.error
    assert len(pool.cached_block_hash_to_block) == 0
    finished = []
    while llm_engine.has_unfinished_requests():
        finished += [o for o in llm_engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["in-flight"]
    assert len(finished[0].outputs[0].token_ids) == 40  # preempted, then completed
    assert _greedy(engine) == hf_greedy(new, PROMPTS, NEW_TOKENS)


def test_a_push_may_leave_whole_modules_out(engine: VLLMInProcess,
                                           model_dirs: dict[str, Path]) -> None:
    first = perturb(load_tiny(model_dirs["llama"]), seed=311)
    _push(engine, first, "keep-1")
    second = perturb(load_tiny(model_dirs["llama"]), seed=312)
    keep = ["model.layers.1", "model.embed_tokens"]
    report = _push(engine, second, "keep-2", keep=keep)
    assert report.tensors < len(second.state_dict())
    # what a fresh load of these weights answers: the second model, with the kept
    # modules as the engine held them (the first push's)
    expected = copy.deepcopy(second)
    kept = {n: t for n, t in first.state_dict().items()
            if n.startswith(("model.layers.1.", "model.embed_tokens."))}
    expected.load_state_dict(kept, strict=False)
    assert _greedy(engine) == hf_greedy(expected, PROMPTS, NEW_TOKENS)
    info = engine.handle().info(60)[0]
    assert info["verification"]["last"]["ok"] is True, info["verification"]
    assert info["version"] == "keep-2" and info["state"] == "current"


def test_a_module_sent_in_part_is_refused_and_nothing_changes(
        engine: VLLMInProcess, model_dirs: dict[str, Path]) -> None:
    before = _greedy(engine)
    version = engine.handle().info(60)[0]["version"]
    model = perturb(load_tiny(model_dirs["llama"]), seed=321)
    # q_proj alone: vLLM fuses q, k and v into one parameter
    with pytest.raises(ManifestError, match=r"missing from the update \(engines reload") as e:
        _push(engine, model, "keep-bad", keep=["model.layers.0.self_attn.q_proj"])
    assert "model.layers.0.self_attn.q_proj.weight" in str(e.value)
    assert _greedy(engine) == before
    assert engine.handle().info(60)[0]["version"] == version
