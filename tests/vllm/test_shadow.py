"""The streamed verification shadow in a real vLLM (CPU, bf16: every linear prepacked).

An eight-layer model, where a decoder layer is most of the weights: a verified update
builds its fresh-load shadow one unit at a time (each layer, then the rest), so the
shadow's tensors alive at once are about one layer's, where the whole shadow holds the
model again. A clean push compares equal everywhere (a shadow built unit by unit that
were not vLLM's fresh load would differ from the live model and be reported as a
repair), and the same push verified on a whole shadow compares exactly the same tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from enginehooks import WeightSync
from enginehooks.demo.tiny import make_tiny_model
from enginehooks_testkit.engines import VLLMInProcess
from enginehooks_testkit.tiny import load_tiny, perturb
from tests.support import requires_vllm

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]

LAYERS, HIDDEN = 8, 256


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("deep") / "qwen2", arch="qwen2",
                           hidden_size=HIDDEN, layers=LAYERS, heads=4, kv_heads=2,
                           tie_word_embeddings=True, seed=3)


@pytest.fixture(scope="module")
def engine(deep: Path) -> Iterator[VLLMInProcess]:
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("ENGINEHOOKS_VERIFY", raising=False)  # the default policy: always
        mp.delenv("ENGINEHOOKS_SHADOW", raising=False)  # the default: streamed
        # the shadow itself, unit by unit, is what this tests: with twins (the default)
        # the steady state's planned layers are compared with their twins instead
        mp.setenv("ENGINEHOOKS_TWIN", "off")
        with VLLMInProcess(deep, dtype="bfloat16") as llm:
            yield llm


def _last(engine: VLLMInProcess) -> dict[str, Any]:
    return engine.handle().info(30)[0]["verification"]["last"]  # type: ignore[no-any-return]


def test_the_shadow_holds_one_layer_at_a_time(engine: VLLMInProcess, deep: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = [perturb(load_tiny(deep), seed=s).to(torch.bfloat16) for s in (11, 12)]
    layer = sum(p.nbytes for p in trainer[0].model.layers[0].parameters())
    model_bytes = sum(p.nbytes for p in trainer[0].parameters())
    assert layer * LAYERS > 0.8 * model_bytes  # the layers are most of the model
    with WeightSync("gloo", bucket_bytes=1 << 20, timeout_s=120) as sync:
        sync.add_replica(engine.handle())
        sync.push(trainer[0], version=1)  # records the copy plan, checked unit by unit
        v = _last(engine)
        assert v["outcome"] == "verified" and v["shadow_kind"] == "streamed", v
        assert engine.handle().info(30)[0]["copy_plan"]["state"] == "verifying"
        sync.push(trainer[1], version=2)  # the plan's first use: verified in full
        v = _last(engine)
        assert v["outcome"] == "verified" and v["shadow_kind"] == "streamed", v
        sync.push(trainer[0], version=3)  # steady state: prepacked linears need a shadow
        streamed = _last(engine)
        assert streamed["outcome"] == "verified" and streamed["mismatched"] == [], streamed
        assert streamed["shadow_kind"] == "streamed", streamed
        assert streamed["shadow_units"] == LAYERS + 1, streamed  # each layer, then the rest
        # what the shadow held at once: one layer (its loaded weights, or what vLLM's
        # processing made of them), not the model
        assert streamed["shadow_tensor_bytes"] <= 1.5 * layer, (streamed, layer)

        monkeypatch.setenv("ENGINEHOOKS_SHADOW", "whole")  # the worker is this process
        sync.push(trainer[1], version=4)
        whole = _last(engine)
        assert whole["outcome"] == "verified" and whole["shadow_kind"] == "whole", whole
        assert whole["shadow_tensor_bytes"] >= 0.8 * model_bytes - layer, whole
        for key in ("compared", "shadow_bytes", "digest", "digest_bytes"):
            assert whole[key] == streamed[key], key
        assert sorted(whole["probed"]) == sorted(streamed["probed"])
