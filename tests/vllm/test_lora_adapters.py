"""LoRA adapters pushed unmerged into a real vLLM server (`WeightSync.push_adapter`): only
the adapter's bytes move, vLLM's own adapter loader loads them, several versions serve at
once under `name@version`, the oldest beyond `keep` are unloaded, and a refused adapter
changes nothing.

The exact oracle here: generation with a pushed version (greedy tokens and every chosen
token's logprob, cold prefix cache) equals the same server generating with the adapter
loaded from disk, from PEFT's `save_pretrained` of the same adapter, through vLLM's own
`/v1/load_lora_adapter` (the base weights are the same in both: only the adapter differs).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from enginehooks import WeightSync
from enginehooks.control._http import request_json
from enginehooks.core.errors import ConfigError, HTTPStatusError
from enginehooks.vllm_ext import VLLMServer
from enginehooks.vllm_ext.fail_closed import ADAPTER_ROUTE
from enginehooks.wire.adapters import AdapterUpload
from enginehooks_testkit.engines import PROMPTS
from enginehooks_testkit.tiny import load_tiny
from tests.vllm.conftest import VLLMServerProcess

peft = pytest.importorskip("peft")

RANK = 8
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


@pytest.fixture(scope="module")
def lora_server(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[VLLMServerProcess]:
    log = tmp_path_factory.mktemp("logs") / "vllm-lora.log"
    env = {**__import__("os").environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    lora = ["--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "4"]
    with VLLMServerProcess(model_dirs["llama"], log, env=env, extra_args=lora) as srv:
        yield srv


@pytest.fixture(scope="module")
def policy(model_dirs: dict[str, Path]) -> Any:
    torch.manual_seed(0)
    config = peft.LoraConfig(r=RANK, lora_alpha=16, target_modules=TARGETS,
                             init_lora_weights=False)
    return peft.get_peft_model(load_tiny(model_dirs["llama"]), config)


def train(model: Any, seed: int) -> None:
    """A reproducible change to the adapter's weights only (the base stays frozen)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.5)


def generate(server: VLLMServerProcess, model: str) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs for every test prompt, from a cold prefix cache."""
    request_json(f"{server.url}/reset_prefix_cache", {}, timeout_s=60)
    out = []
    for prompt in PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "logprobs": 0}
        choice = request_json(f"{server.url}/v1/completions", body, timeout_s=60)["choices"][0]
        out.append((list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"])))
    return out


def from_disk(server: VLLMServerProcess, model: Any, folder: Path, name: str) -> str:
    """The oracle's side: PEFT writes the adapter, vLLM loads it from that folder."""
    model.save_pretrained(folder)
    request_json(f"{server.url}/v1/load_lora_adapter",
                 {"lora_name": name, "lora_path": str(folder)}, timeout_s=120)
    return name


def served_models(server: VLLMServerProcess) -> set[str]:
    return {m["id"] for m in request_json(f"{server.url}/v1/models", None, timeout_s=30)["data"]}


def test_adapter_versions_equal_a_load_from_disk_and_serve_side_by_side(
        lora_server: VLLMServerProcess, policy: Any, tmp_path: Path) -> None:
    sync = WeightSync(timeout_s=120)
    sync.add_replica(VLLMServer(lora_server.url))
    base = generate(lora_server, lora_server.model)

    train(policy, 1)
    first = sync.push_adapter(policy, 1, name="policy", keep=2)
    assert first.served == "policy@1" and first.unloaded == []
    # only the adapter moved: a few percent of the model's bytes
    model_bytes = sum(p.numel() * p.element_size() for p in policy.get_base_model().parameters())
    assert first.bytes_per_replica < model_bytes / 5
    v1 = generate(lora_server, "policy@1")
    assert v1 == generate(lora_server, from_disk(lora_server, policy, tmp_path / "v1", "disk1"))
    assert [t for t, _ in v1] != [t for t, _ in base], "the adapter must change the answer"

    train(policy, 2)
    sync.push_adapter(policy, 2, name="policy", keep=2)
    v2 = generate(lora_server, "policy@2")
    assert v2 == generate(lora_server, from_disk(lora_server, policy, tmp_path / "v2", "disk2"))
    assert v2 != v1
    assert generate(lora_server, "policy@1") == v1, "an older live version kept its answers"

    train(policy, 3)
    third = sync.push_adapter(policy, 3, name="policy", keep=2)
    assert third.unloaded == ["policy@1"]
    live = served_models(lora_server)
    assert {"policy@2", "policy@3"} <= live and "policy@1" not in live
    assert generate(lora_server, "policy@2") == v2
    assert generate(lora_server, lora_server.model) == base, "the base weights are untouched"


def test_an_adapter_the_engine_refuses_changes_nothing(
        lora_server: VLLMServerProcess, model_dirs: dict[str, Path]) -> None:
    """A rank above the server's --max-lora-rank: vLLM's loader refuses it; the error says
    so, no version is served, and the upload's folder is gone again (the same version can
    be pushed once fixed)."""
    before = served_models(lora_server)
    config = peft.LoraConfig(r=RANK * 2, target_modules=TARGETS, init_lora_weights=False)
    wide = peft.get_peft_model(load_tiny(model_dirs["llama"]), config)
    sync = WeightSync(timeout_s=120)
    sync.add_replica(VLLMServer(lora_server.url))
    with pytest.raises(ConfigError, match="refused adapter wide@1"):
        sync.push_adapter(wide, 1, name="wide")
    assert served_models(lora_server) == before

    narrow = peft.get_peft_model(
        load_tiny(model_dirs["llama"]),
        peft.LoraConfig(r=RANK, target_modules=TARGETS, init_lora_weights=False))
    assert sync.push_adapter(narrow, 1, name="wide").served == "wide@1"


def test_a_tampered_upload_is_refused_before_anything_is_written(
        lora_server: VLLMServerProcess, policy: Any) -> None:
    from enginehooks.control.adapters import adapter_upload

    upload = adapter_upload(policy, "t1", name="tampered")
    body = upload.body()
    flipped = bytearray(upload.weights)
    flipped[-1] ^= 1
    body["weights"] = AdapterUpload("tampered", "t1", upload.config, bytes(flipped),
                                    upload.sha256).body()["weights"]
    with pytest.raises(HTTPStatusError, match="sha256") as e:
        request_json(f"{lora_server.url}{ADAPTER_ROUTE}", body, timeout_s=60)
    assert e.value.status == 400
    # nothing was stored: the genuine upload of the same version goes through
    server = VLLMServer(lora_server.url)
    assert server.load_adapter(upload, 120) == "tampered@t1"
    assert json.dumps(sorted(served_models(lora_server))).count("tampered@t1") == 1
