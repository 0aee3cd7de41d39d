"""Plain-module and state-dict adapters: HF names, dtype cast, laziness."""

from __future__ import annotations

import torch
from torch import nn

from enginehooks import WeightSync
from enginehooks.engine.local import LocalEngine
from enginehooks.trainer_side import ModuleAdapter, StateDictAdapter, adapter_for, hf_name


def test_wrapper_prefixes_are_stripped() -> None:
    assert hf_name("module._orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.weight") \
        == "model.layers.0.mlp.weight"
    assert hf_name("_fsdp_wrapped_module.lm_head.weight") == "lm_head.weight"
    assert hf_name("model.module_list.0.weight") == "model.module_list.0.weight"

    class Wrapper(nn.Module):  # what DDP looks like from the outside
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(3, 2)

    names = [s.name for s in ModuleAdapter(Wrapper()).specs()]
    assert names == ["weight", "bias"]


def test_cast_happens_lazily_per_tensor() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model.register_buffer("steps", torch.tensor([3], dtype=torch.int64))
    adapter = adapter_for(model, dtype=torch.bfloat16)
    assert isinstance(adapter, ModuleAdapter)
    specs = {s.name: s.dtype for s in adapter.specs()}
    assert specs["0.weight"] == "bfloat16" and specs["steps"] == "int64"  # only floats cast
    stream = adapter.stream()  # a generator: nothing is cast before it is pulled
    name, steps = next(stream)  # a module's own buffers come before its children's
    assert name == "steps" and steps.dtype == torch.int64
    name, weight = next(stream)
    assert name == "0.weight" and weight.dtype == torch.bfloat16
    assert torch.equal(weight, model[0].weight.detach().to(torch.bfloat16))


def test_state_dict_adapter_pushes_a_mapping() -> None:
    src = {"weight": torch.randn(4, 4), "bias": torch.randn(4)}
    dst = nn.Linear(4, 4)
    adapter = adapter_for(src)
    assert isinstance(adapter, StateDictAdapter)
    with WeightSync("gloo", timeout_s=30) as sync:
        sync.add_replica(LocalEngine(dst))
        sync.push(adapter, version=1)
    assert adapter.produced == 2
    assert torch.equal(dst.weight, src["weight"]) and torch.equal(dst.bias, src["bias"])
