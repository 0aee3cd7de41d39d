"""vLLM's own weight-transfer routes with backend "enginehooks", on a real vLLM server
in dev mode (float32, so greedy tokens can be compared with HF transformers'):
`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`, driven by vLLM's trainer-side factory through vLLM's own HTTP
client (paused around the push, as vLLM's RL pattern does) and through
`VLLMServer` as the client (which flushes the prefix cache itself)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from enginehooks import ManifestError
from enginehooks.control._http import request_json
from enginehooks.vllm_ext import VLLMServer
from enginehooks_testkit.engines import NEW_TOKENS, PROMPTS
from enginehooks_testkit.tiny import hf_greedy, load_tiny, perturb
from tests.support import requires_vllm

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]


def push(client: Any, model: Any, version: str) -> Any:
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from enginehooks.vllm_ext.transfer_trainer import EnginehooksTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        EnginehooksTrainerInitInfo(rank=0, world_size=2, timeout_s=60, bucket_bytes=32 << 10),
        client=client, source=ModuleSource(model))
    try:
        return engine.send_weights(weight_version=version)
    finally:
        engine.shutdown()


def test_vllm_http_client_through_routes_matches_hf(vllm_server: Any,
                                                     model_dirs: dict[str, Path]) -> None:
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    url = vllm_server.url
    model = perturb(load_tiny(model_dirs["llama"]), seed=101)
    before = vllm_server.greedy()
    request_json(f"{url}/pause", {}, timeout_s=60)  # clears the caches (vLLM's default)
    try:
        report = push(HTTPVLLMWeightSyncClient(url, timeout=60), model, "routes-1")
    finally:
        request_json(f"{url}/resume", {}, timeout_s=60)
    assert report.ok and report.buckets > 1
    assert request_json(f"{url}/weight_info", timeout_s=30) == {"weight_version": "routes-1"}
    after = vllm_server.greedy()
    assert after != before
    assert after == hf_greedy(model, PROMPTS, NEW_TOKENS)
    assert VLLMServer(url).version() == "routes-1"  # the worker extension sees it too


def test_vllmserver_as_client_refuses_then_pushes(vllm_server: Any,
                                                  model_dirs: dict[str, Path]) -> None:
    url = vllm_server.url
    client = VLLMServer(url, name="routes", timeout_s=60)
    model = perturb(load_tiny(model_dirs["llama"]), seed=102)
    push(client, model, "routes-2")
    tokens = vllm_server.greedy()
    assert tokens == hf_greedy(model, PROMPTS, NEW_TOKENS)  # no pause: the client flushed
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(torch.zeros(300, 64))  # wrong vocabulary
    with pytest.raises(ManifestError, match=r"'routes' refused the update.*lm_head\.weight"):
        push(client, model, "routes-bad")
    assert client.engine_version() == "routes-2" and client.version() == "routes-2"
    assert vllm_server.greedy() == tokens
