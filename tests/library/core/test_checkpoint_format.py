"""The trainer side streams exactly what `save_pretrained` writes (names, shapes, bytes),
for every family of the conformance matrix, one layer at a time; what transformers
cannot map is refused in the plan, before anything moves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from enginehooks import ManifestError, WeightSync
from enginehooks.engine.local import LocalEngine
from enginehooks.trainer_side import ModuleAdapter, adapter_for
from enginehooks_testkit.tiny import perturb
from tests.engines.conformance.families import FAMILIES


def model_of(family: str, tmp: Path) -> Any:
    import transformers

    from tests.engines.conformance.families import build

    fam = FAMILIES[family]
    folder = build(fam, "vllm", tmp / family)
    cls = getattr(transformers, fam.model_class) if fam.model_class else transformers.AutoModelForCausalLM
    return perturb(cls.from_pretrained(folder, dtype=torch.float32), seed=3)


def saved(model: Any, tmp: Path) -> dict[str, torch.Tensor]:
    model.save_pretrained(tmp / "saved")
    out: dict[str, torch.Tensor] = {}
    for f in sorted((tmp / "saved").glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_stream_is_what_save_pretrained_writes(family: str, tmp_path: Path) -> None:
    model = model_of(family, tmp_path)
    adapter = adapter_for(model)
    specs = adapter.specs()
    streamed = dict(adapter.stream())
    want = saved(model, tmp_path)
    assert [s.name for s in specs] == list(streamed), "the stream breaks its own plan"
    assert sorted(streamed) == sorted(want)
    for name, t in streamed.items():
        assert t.dtype == want[name].dtype and t.shape == want[name].shape, name
        assert torch.equal(t, want[name]), name


def test_moe_experts_travel_per_expert_one_layer_at_a_time(tmp_path: Path) -> None:
    model = model_of("qwen3_moe", tmp_path)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in model.state_dict()), \
        "transformers keeps experts fused in the module"
    adapter = ModuleAdapter(model)
    produced: list[list[str]] = []
    inner = adapter._produce

    def spy(names: Any) -> Any:
        produced.append(list(names))
        return inner(names)

    adapter._produce = spy  # type: ignore[method-assign]
    names = [n for n, _ in adapter.stream()]
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names
    layers = [{n.split(".")[2] for n in group if n.startswith("model.layers.")} for group in produced]
    assert all(len(ls) <= 1 for ls in layers), f"a group spans layers: {layers}"
    assert len(produced) >= 2 + 2, "the model was produced at once, not per layer"


def test_a_model_transformers_cannot_map_is_refused_in_the_plan(tmp_path: Path) -> None:
    model = model_of("llama", tmp_path)
    # Two weights made to share storage that the model does not declare as tied:
    # save_pretrained refuses it too (shared tensors not properly defined).
    mlp = model.model.layers[0].mlp
    mlp.up_proj.weight = mlp.gate_proj.weight
    with pytest.raises(RuntimeError, match="shared tensors"):
        model.save_pretrained(tmp_path / "refused")
    replica = LocalEngine({"x": torch.zeros(1)})
    with WeightSync("gloo", timeout_s=20) as sync:
        sync.add_replica(replica)
        with pytest.raises(ManifestError, match="transformers cannot tell the tied weights"):
            sync.push(model, version=1)
    assert replica.side.version is None
