"""The streamed verification shadow in a real SGLang (CPU).

An eight-layer model, where a decoder layer is most of the weights, in an SGLang started
with the copy plan off (`ENGINEHOOKS_COPY_PLAN=off`: every tensor goes through SGLang's
loader, so no digest proves anything and every touched module is left to the shadow).
Each verified push builds the fresh-load shadow one unit at a time (each layer, then the
rest): the tensors it held at once are about one layer's, not the model's, and the push
compares equal everywhere (a shadow built unit by unit that were not SGLang's fresh
load would differ from the live model and be reported as a repair).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enginehooks import WeightSync
from enginehooks.demo.tiny import make_tiny_model
from enginehooks_testkit.engines import SGLangInProcess
from enginehooks_testkit.tiny import load_tiny, perturb

LAYERS, HIDDEN = 8, 256


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("deep") / "qwen2", arch="qwen2",
                           hidden_size=HIDDEN, layers=LAYERS, heads=4, kv_heads=2,
                           tie_word_embeddings=True, seed=3)


@pytest.fixture(scope="module")
def engine(deep: Path) -> Iterator[SGLangInProcess]:
    with pytest.MonkeyPatch.context() as mp:  # read by the scheduler as it starts
        mp.delenv("ENGINEHOOKS_VERIFY", raising=False)
        mp.delenv("ENGINEHOOKS_SHADOW", raising=False)
        mp.setenv("ENGINEHOOKS_COPY_PLAN", "off")
        engine = SGLangInProcess(deep)
    try:
        yield engine
    finally:
        engine.close()


def _last(engine: SGLangInProcess) -> dict[str, Any]:
    return engine.handle().info(30)[0]["verification"]["last"]  # type: ignore[no-any-return]


def test_the_shadow_holds_one_layer_at_a_time(engine: SGLangInProcess, deep: Path) -> None:
    trainer = [perturb(load_tiny(deep), seed=s) for s in (21, 22, 21)]
    layer = sum(p.nbytes for p in trainer[0].model.layers[0].parameters())
    model_bytes = sum(p.nbytes for p in trainer[0].parameters())
    assert layer * LAYERS > 0.8 * model_bytes  # the layers are most of the model
    with WeightSync("gloo", bucket_bytes=1 << 20, timeout_s=120) as sync:
        sync.add_replica(engine.handle())
        for version, model in enumerate(trainer, 1):
            sync.push(model, version=version)
            v = _last(engine)
            assert v["outcome"] == "verified" and v["mismatched"] == [], v
            assert v["shadow_why"] == "", v
            assert v["how"] == "shadow" and v["shadow_kind"] == "streamed", v
            assert v["shadow_units"] == LAYERS + 1, v  # each layer, then the rest
            assert v["shadow_tensor_bytes"] <= 1.5 * layer, (v, layer)
            assert v["shadow_bytes"] >= 0.9 * model_bytes, v  # yet it compared everything
