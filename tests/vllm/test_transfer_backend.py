"""Backend "enginehooks" of vLLM's weight-transfer API, the parts that need no running
engine: registration (idempotent, as vLLM loads plugins in every process, and refusing
a name already taken), the trainer-side init info and client checks, and the
`WeightSource` adapter's check of iteration against metadata. The engine side runs for
real in tests/vllm/test_vllm_weight_transfer.py and test_quickstart.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from enginehooks import ConfigError, ManifestError, PluginError
from tests.support import requires_vllm

pytestmark = requires_vllm


def test_registration_is_idempotent_and_guards_the_name() -> None:
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    from enginehooks.vllm_ext import plugin

    plugin.register()
    plugin.register()  # vLLM loads general plugins again in every process
    worker = WeightTransferEngineFactory._registry["enginehooks"]()
    trainer = WeightTransferTrainerFactory._registry["enginehooks"]()
    assert (worker.__module__, worker.__name__) == plugin.WORKER_SIDE
    assert (trainer.__module__, trainer.__name__) == plugin.TRAINER_SIDE
    saved = WeightTransferEngineFactory._registry.pop("enginehooks")
    try:
        WeightTransferEngineFactory.register_engine(
            "enginehooks", "vllm.distributed.weight_transfer.nccl_engine",
            "NCCLWeightTransferEngine")
        with pytest.raises(PluginError, match=r"already taken by .*NCCLWeightTransferEngine"):
            plugin.register()
    finally:
        WeightTransferEngineFactory._registry["enginehooks"] = saved


def test_entry_point_is_declared_for_vllm() -> None:
    from tests.support.entry_points import declared

    assert declared("vllm.general_plugins") == {
        "enginehooks": "enginehooks.vllm_ext.plugin:register"}


def test_trainer_init_info_and_client_are_checked() -> None:
    from enginehooks.vllm_ext.transfer_trainer import ClientReplica, EnginehooksTrainerInitInfo

    with pytest.raises(ConfigError, match="world_size"):
        EnginehooksTrainerInitInfo(rank=0, world_size=1)
    assert EnginehooksTrainerInitInfo(rank=0).backend == "enginehooks"
    with pytest.raises(ConfigError, match="not a vLLM weight-sync client"):
        ClientReplica(object(), workers=1)


def test_worker_init_and_update_info_are_checked() -> None:
    from enginehooks.vllm_ext.transfer_engine import EnginehooksInitInfo, EnginehooksUpdateInfo

    with pytest.raises(ConfigError, match="endpoint"):
        EnginehooksInitInfo(endpoint={"host": "x"})
    with pytest.raises(ConfigError, match="rank_offset"):
        EnginehooksInitInfo(endpoint={"transport": "gloo", "world_size": 2}, rank_offset=0)
    with pytest.raises(ConfigError, match="phase"):
        EnginehooksUpdateInfo(manifest="{}", phase="apply")


class Disagreeing:
    """A WeightSource whose iteration does not follow its metadata."""

    def __new__(cls, model: nn.Module, swap: bool) -> object:
        from vllm.distributed.weight_transfer import ModuleSource

        class Source(ModuleSource):
            def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
                items = list(super().__iter__())
                if swap:
                    items[0], items[1] = items[1], items[0]
                else:
                    items[0] = (items[0][0], items[0][1][:1])
                return iter(items)

        return Source(model)


def test_weight_source_adapter_plans_and_checks_iteration() -> None:
    from vllm.distributed.weight_transfer import ModuleSource

    from enginehooks.vllm_ext.transfer_trainer import WeightSourceAdapter

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    adapter = WeightSourceAdapter(ModuleSource(model), dtype=torch.bfloat16)
    assert WeightSourceAdapter.accepts(ModuleSource(model)) and not WeightSourceAdapter.accepts(model)
    specs = adapter.specs()
    assert [(s.name, s.dtype, s.shape) for s in specs] == [
        ("0.weight", "bfloat16", (3, 4)), ("0.bias", "bfloat16", (3,)),
        ("1.weight", "bfloat16", (2, 3)), ("1.bias", "bfloat16", (2,))]
    sent = dict(adapter.stream())
    assert torch.equal(sent["1.weight"], model[1].weight.detach().to(torch.bfloat16))
    with pytest.raises(ManifestError, match=r"yielded '0\.bias' where .* declared '0\.weight'"):
        list(WeightSourceAdapter(Disagreeing(model, swap=True)).stream())
    with pytest.raises(ManifestError, match=r"'0\.weight' with shape \[1, 4\]"):
        list(WeightSourceAdapter(Disagreeing(model, swap=False)).stream())
