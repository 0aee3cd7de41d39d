"""The Megatron adapter's error handling and its expert-name view, in one process, with
FAKE bridges (stand-ins that yield fixed tensors): what the adapter does with a bridge,
not what a bridge does. The real thing (megatron-core + mbridge, 2 ranks, real engines)
is test_megatron_push.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from enginehooks.core.errors import EngineHooksError, ManifestError
from enginehooks.core.manifest import TensorSpec
from enginehooks.trainer_side.megatron import (
    GroupedExpertNames,
    MegatronBridgeAdapter,
    grouped_expert_name,
    grouped_expert_names,
)


class FakeMBridge:
    """FAKE mbridge: `export_weights(models)` yields `tensors`; records what it was given."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.tensors = tensors
        self.seen: list[Any] = []

    def export_weights(self, models: list[Any]) -> Iterator[tuple[str, torch.Tensor]]:
        self.seen = models
        yield from self.tensors


class FakeMegatronBridge:
    """FAKE Megatron-Bridge: `export_hf_weights(model, cpu=..., show_progress=...)`."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.tensors = tensors
        self.kwargs: dict[str, Any] = {}

    def export_hf_weights(self, model: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        self.kwargs = kwargs
        yield from self.tensors


def tensors() -> list[tuple[str, torch.Tensor]]:
    return [("model.embed_tokens.weight", torch.ones(4, 2)), ("lm_head.weight", torch.zeros(4, 2))]


def test_missing_or_wrong_bridge_is_a_clear_error() -> None:
    with pytest.raises(EngineHooksError, match="pushes through its bridge"):
        MegatronBridgeAdapter(torch.nn.Linear(2, 2))
    with pytest.raises(EngineHooksError, match="is not a Megatron bridge"):
        MegatronBridgeAdapter(torch.nn.Linear(2, 2), bridge=object())


@pytest.mark.parametrize("bridge_cls", [FakeMBridge, FakeMegatronBridge])
def test_streams_what_the_bridge_exports_and_plans_once(bridge_cls: type) -> None:
    bridge = bridge_cls(tensors())
    adapter = MegatronBridgeAdapter(torch.nn.Linear(2, 2), bridge=bridge, dtype=torch.bfloat16)
    specs = adapter.specs()
    assert [(s.name, s.dtype, s.shape) for s in specs] == [
        ("model.embed_tokens.weight", "bfloat16", (4, 2)), ("lm_head.weight", "bfloat16", (4, 2))]
    got = dict(adapter.stream())
    assert got["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert torch.equal(got["model.embed_tokens.weight"], torch.ones(4, 2, dtype=torch.bfloat16))
    adapter.specs()
    dict(adapter.stream())
    assert adapter.dry_runs == 1  # the plan is cached after the first push
    if bridge_cls is FakeMegatronBridge:
        assert bridge.kwargs == {"cpu": True, "show_progress": False}


def test_a_stream_that_differs_from_the_plan_is_refused() -> None:
    bridge = FakeMBridge(tensors())
    plan = [TensorSpec("model.embed_tokens.weight", "float32", (4, 2)),
            TensorSpec("lm_head.weight", "float32", (5, 2))]  # wrong shape
    adapter = MegatronBridgeAdapter(torch.nn.Linear(2, 2), bridge=bridge, specs=plan)
    adapter.specs()
    with pytest.raises(ManifestError, match=r"does not match the plan at tensor 1: it produced "
                                            r"lm_head.weight \(4, 2\)"):
        dict(adapter.stream())


def test_a_name_exported_twice_is_refused_in_plan() -> None:
    bridge = FakeMBridge([*tensors(), ("lm_head.weight", torch.zeros(4, 2))])
    with pytest.raises(ManifestError, match=r"lm_head\.weight.*more than once"):
        MegatronBridgeAdapter(torch.nn.Linear(2, 2), bridge=bridge).specs()


def test_sequential_expert_names_as_grouped_ones() -> None:
    assert grouped_expert_name("decoder.layers.3.mlp.experts.local_experts.1.linear_fc1.weight") \
        == "decoder.layers.3.mlp.experts.linear_fc1.weight1"
    assert grouped_expert_name("decoder.layers.0.mlp.experts.local_experts.12.linear_fc2.weight") \
        == "decoder.layers.0.mlp.experts.linear_fc2.weight12"
    for other in ("decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.router.weight",
                  "decoder.layers.0.mlp.experts.linear_fc1.weight0"):
        assert grouped_expert_name(other) == other

    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.local_experts = torch.nn.ModuleList(
                torch.nn.ModuleDict({"linear_fc1": torch.nn.Linear(2, 4, bias=False)})
                for _ in range(2))

    class Mlp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = Experts()
            self.router = torch.nn.Linear(2, 2, bias=False)

    model = torch.nn.Module()
    model.mlp = Mlp()
    view = grouped_expert_names(model)[0]
    assert isinstance(view, GroupedExpertNames)
    names = dict(view.named_parameters())
    assert sorted(names) == ["mlp.experts.linear_fc1.weight0", "mlp.experts.linear_fc1.weight1",
                             "mlp.router.weight"]
    # the same tensors, not copies: a bridge loading through the view writes the model
    assert names["mlp.experts.linear_fc1.weight1"] is model.mlp.experts.local_experts[1]["linear_fc1"].weight
    view.state_dict()["mlp.experts.linear_fc1.weight0"].fill_(3.0)
    assert bool((model.mlp.experts.local_experts[0]["linear_fc1"].weight == 3.0).all())
    assert view.mlp is model.mlp
    # a model without SequentialMLP experts is handed over as it is
    plain = torch.nn.Linear(2, 2)
    assert grouped_expert_names([plain]) == [plain]
    bridge = FakeMBridge(tensors())
    dict(MegatronBridgeAdapter(model, bridge=bridge).stream())
    assert isinstance(bridge.seen[0], GroupedExpertNames)
