"""Partial updates by whole modules (`core.keep`, `trainer_side.keep`, the engine's
check in `engine.expectations`): an update may leave out whole modules the manifest
names (`meta["keep"]`); every engine module it sends must be whole; a module sent in
part is refused with the same error as before, naming the missing tensors."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch
from torch import nn

from enginehooks.core.errors import ConfigError, ManifestError
from enginehooks.core.keep import kept_modules, under
from enginehooks.core.manifest import TensorSpec
from enginehooks.engine.expectations import CheckpointExpectations, LoaderExpectations
from enginehooks.trainer_side import adapter_for
from enginehooks.trainer_side.keep import LeaveOut, leave_out

MISSING = "missing from the update (engines reload whole layers)"


class Engine(nn.Module):
    """An engine-style model: a fused qkv (three checkpoint tensors into one
    parameter), a layer with weight and bias, a vision tower of two layers, and an
    expert module whose two parameters come from different checkpoint modules."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(4, 12, bias=False)
        self.norm = nn.Linear(4, 4)
        self.tower = nn.ModuleDict({"l0": nn.Linear(4, 4), "l1": nn.Linear(4, 4)})
        self.experts = nn.Module()
        self.experts.w13 = nn.Parameter(torch.zeros(8, 4))
        self.experts.w2 = nn.Parameter(torch.zeros(4, 4))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, w in weights:
            if name.startswith("attn."):
                i = "qkv".index(name.split(".")[1][0])
                self.qkv.weight.data[4 * i:4 * i + 4].copy_(w)
            elif name.startswith("mlp.gate_up."):
                self.experts.w13.data.copy_(w)
            elif name.startswith("mlp.down."):
                self.experts.w2.data.copy_(w)
            else:
                params[name].data.copy_(w)


CHECKPOINT = {
    "attn.q.weight": (4, 4), "attn.k.weight": (4, 4), "attn.v.weight": (4, 4),
    "norm.weight": (4, 4), "norm.bias": (4,),
    "tower.l0.weight": (4, 4), "tower.l0.bias": (4,),
    "tower.l1.weight": (4, 4), "tower.l1.bias": (4,),
    "mlp.gate_up.weight": (8, 4), "mlp.down.weight": (4, 4),
}


def specs(names: Iterable[str]) -> list[TensorSpec]:
    return [TensorSpec(n, "float32", CHECKPOINT[n]) for n in names]


def without(*prefixes: str) -> list[TensorSpec]:
    return specs(n for n in CHECKPOINT if not under(n, prefixes))


@pytest.fixture()
def engine() -> LoaderExpectations:
    def skeleton() -> nn.Module:
        with torch.device("meta"):
            return Engine()

    return LoaderExpectations(skeleton, lambda m, w: m.load_weights(w),
                              dict(zip(CHECKPOINT, specs(CHECKPOINT))), engine="toy")


def test_a_whole_module_left_out_and_declared_is_accepted(engine: LoaderExpectations) -> None:
    assert engine.problems(specs(CHECKPOINT)) == []
    assert engine.problems(without("tower"), keep=["tower"]) == []
    assert engine.kept(without("tower"), ["tower"]) == ["tower.l0", "tower.l1"]
    assert engine.problems(without("tower.l1"), keep=["tower.l1"]) == []
    assert engine.problems(without("norm", "tower"), keep=["norm", "tower"]) == []


def test_without_the_declaration_a_left_out_module_is_still_refused(
        engine: LoaderExpectations) -> None:
    problems = engine.problems(without("tower"))
    assert len(problems) == 1 and MISSING in problems[0] and "tower.l0.bias" in problems[0]


def test_a_module_sent_in_part_is_refused_with_the_same_error(
        engine: LoaderExpectations) -> None:
    # q left out of a fused qkv: the engine parameter still receives k and v
    problems = engine.problems(without("attn.q"), keep=["attn.q"])
    assert len(problems) == 1 and MISSING in problems[0] and "'attn.q.weight'" in problems[0]
    # a layer's bias kept while its weight is sent
    problems = engine.problems(without("norm.bias"), keep=["norm.bias"])
    assert len(problems) == 1 and MISSING in problems[0] and "'norm.bias'" in problems[0]
    # one of two checkpoint modules feeding one engine module (fused experts)
    problems = engine.problems(without("mlp.down"), keep=["mlp.down"])
    assert len(problems) == 1 and MISSING in problems[0] and "'mlp.down.weight'" in problems[0]
    # a left-out module that is not declared, beside one that is
    problems = engine.problems(without("tower", "norm"), keep=["tower"])
    assert len(problems) == 1 and MISSING in problems[0] and "norm.bias" in problems[0]


def test_sending_a_module_declared_kept_is_refused(engine: LoaderExpectations) -> None:
    problems = engine.problems(specs(CHECKPOINT), keep=["tower"])
    assert problems and "declares kept" in problems[0] and "tower.l0.bias" in problems[0]


def test_checkpoint_expectations_take_the_declaration_too() -> None:
    exp = CheckpointExpectations(dict(zip(CHECKPOINT, specs(CHECKPOINT))))
    assert exp.problems(without("tower"), keep=["tower"]) == []
    assert "missing from the update" in exp.problems(without("tower"))[0]


def test_the_manifest_key_is_checked() -> None:
    assert kept_modules({}) == ()
    assert kept_modules({"keep": ["model.vision_tower.", "lm_head"]}) == (
        "model.vision_tower", "lm_head")
    for bad in ("model.vision_tower", [""], [3], {"a": 1}):
        with pytest.raises(ManifestError):
            kept_modules({"keep": bad})
    assert under("tower.l0.weight", ["tower"]) and under("tower", ["tower"])
    assert not under("towers.l0.weight", ["tower"])


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.vision = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.head = nn.Linear(4, 8)


def test_the_trainer_leaves_kept_modules_out_of_the_plan_and_the_stream() -> None:
    model = Tiny()
    adapter = leave_out(adapter_for(model), ["vision"], in_place=True)
    names = [s.name for s in adapter.specs()]
    assert names == ["embed.weight", "head.weight", "head.bias"]
    assert [n for n, _ in adapter.stream()] == names
    # an adapter the caller owns is wrapped, not changed
    mine = adapter_for(model)
    wrapped = leave_out(mine, ["vision.0"])
    assert isinstance(wrapped, LeaveOut)
    assert "vision.0.weight" in [s.name for s in mine.specs()]
    assert [n for n, _ in wrapped.stream()] == [s.name for s in wrapped.specs()]
    assert "vision.0.weight" not in [s.name for s in wrapped.specs()]
    # a state dict is filtered as it streams
    sd = leave_out(adapter_for(dict(model.state_dict())), ["embed"])
    assert [s.name for s in sd.specs()] == [n for n, _ in sd.stream()]
    assert not any(under(s.name, ["embed"]) for s in sd.specs())


def test_a_kept_name_that_matches_nothing_or_everything_is_refused() -> None:
    with pytest.raises(ConfigError, match="name no tensors"):
        leave_out(adapter_for(Tiny()), ["vision_tower"], in_place=True)
    with pytest.raises(ConfigError, match="leaves nothing"):
        leave_out(adapter_for(Tiny()), ["embed", "vision", "head"], in_place=True)
    with pytest.raises(ConfigError):
        leave_out(adapter_for(Tiny()), [""])
