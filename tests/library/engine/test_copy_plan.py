"""The copy plan on torch modules whose `load_weights` do what engines' loaders do.

The engines' loaders run for real in tests/vllm/test_copy_plan.py and the conformance
cells; here each way a loader can treat a tensor is pinned down on its own, so a
regression names it: a fused destination sliced with `narrow` (planned), a transposed
source (planned), a scaled tensor (loader), `.item()` + `fill_` (loader), a padded
vocabulary filled with zeros after the copy (planned, fill included), and a loader that
disagrees with its own recorded plan (the plan is disabled, naming the tensor).
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch
from torch import nn

from enginehooks.core.dtypes import dtype_name
from enginehooks.core.manifest import TensorSpec
from enginehooks.engine.copy_plan import (
    PLAN_ENV,
    PlanState,
    check_plan,
    coverage,
    record_plan,
    replay,
)


class Fused(nn.Module):
    """qkv and gate_up fused as vLLM / SGLang fuse them, a padded embedding, a scaled
    tensor, a one-element tensor loaded through `.item()`, a transposed source."""

    def __init__(self, scale: float = 2.0) -> None:
        super().__init__()
        self.qkv = nn.Parameter(torch.zeros(12, 4))
        self.embed = nn.Parameter(torch.zeros(8, 4))   # 6 rows loaded, 2 rows of padding
        self.scaled = nn.Parameter(torch.zeros(4))
        self.one = nn.Parameter(torch.zeros(1))
        self.wt = nn.Parameter(torch.zeros(3, 5))
        self.norm = nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))  # the copy casts
        self.plain = nn.Parameter(torch.zeros(3, 3))
        self.scale = scale

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            if name in ("q", "k", "v"):
                i = "qkv".index(name)
                self.qkv.data.narrow(0, 4 * i, 4).copy_(w)
            elif name == "embed":
                self.embed.data[: w.shape[0]].copy_(w)
                self.embed.data[w.shape[0]:].fill_(0)
            elif name == "scaled":
                self.scaled.data.copy_(w * self.scale)
            elif name == "one":
                self.one.data.fill_(w.item())
            elif name == "wt":
                self.wt.data.copy_(w.t())
            elif name == "norm":
                self.norm.data.copy_(w)
            elif name == "plain":
                self.plain.data.copy_(w)


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"q": torch.randn(4, 4, generator=g), "k": torch.randn(4, 4, generator=g),
            "v": torch.randn(4, 4, generator=g), "embed": torch.randn(6, 4, generator=g),
            "scaled": torch.randn(4, generator=g), "one": torch.randn(1, generator=g),
            "wt": torch.randn(5, 3, generator=g), "norm": torch.randn(4, generator=g),
            "plain": torch.randn(3, 3, generator=g)}


def specs(ws: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in ws.items()]


def meta_model(**kw: float) -> Fused:
    with torch.device("meta"):
        return Fused(**kw)


def load(model: nn.Module, items: Iterable[tuple[str, torch.Tensor]]) -> None:
    model.load_weights(items)  # type: ignore[operator]


def tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.data for n, p in model.named_parameters()}


def test_views_plus_one_copy_are_planned_and_computation_stays_on_the_loader() -> None:
    ws = weights()
    plan = record_plan(meta_model(), specs(ws), load)
    assert sorted(plan.planned()) == ["embed", "k", "norm", "plain", "q", "v", "wt"]
    loader = plan.loader()
    assert set(loader) == {"scaled", "one"}
    assert "mul" in loader["scaled"]                 # the op that keeps it on the loader
    assert "_local_scalar_dense" in loader["one"]
    # the fused destination: three disjoint row blocks of qkv
    assert [s.view.offset for n in "qkv" for s in plan.routes[n].steps] == [0, 16, 32]
    # the padded embedding: a copy then a constant fill of the padding
    assert [s.value for s in plan.routes["embed"].steps] == [None, 0]
    assert coverage(plan, plan.planned()) == {"qkv": True, "embed": True, "wt": True,
                                              "norm": True, "plain": True}
    assert coverage(plan, ["q", "k"]) == {"qkv": False}


def test_replay_equals_the_loader_bit_for_bit() -> None:
    ws = weights()
    plan = record_plan(meta_model(), specs(ws), load)
    by_loader = Fused()
    by_loader.load_weights(ws.items())
    assert check_plan(plan, tensors(by_loader), ws) is None
    by_plan = Fused()
    with torch.no_grad():
        for name in plan.planned():
            replay(plan.routes[name], ws[name], tensors(by_plan))
        by_plan.load_weights((n, ws[n]) for n in plan.loader())
    for name, p in by_loader.named_parameters():
        assert torch.equal(p, dict(by_plan.named_parameters())[name]), name


def test_a_plan_that_disagrees_with_the_loader_is_disabled() -> None:
    # Recorded on a skeleton whose loader scales by 1 (a multiplication: loader), then
    # an injected difference: a plan claiming "scaled" is a plain copy, checked against
    # the real loader that doubles it. check_plan must name it and PlanState turn off.
    ws = weights()
    plan = record_plan(meta_model(), specs(ws), load)
    route = plan.routes["scaled"]
    route.reason = None
    route.steps = list(plan.routes["norm"].steps)
    route.steps = [type(s)("scaled", type(s.view)(0, (4,), (1,)), type(s.view)(0, (4,), (1,)))
                   for s in route.steps]
    plan.layouts["scaled"] = type(plan.layouts["qkv"])((4,), (1,), torch.float32)
    real = Fused(scale=2.0)
    real.load_weights(ws.items())
    problem = check_plan(plan, tensors(real), ws)
    assert problem is not None and "scaled" in problem
    state = PlanState("test")
    state.adopt(plan, problem)
    assert state.state == "off" and "scaled" in (state.reason or "")
    assert not state.usable
    assert all(route is None for _, _, route in state.split(ws.items()))


def test_an_element_the_plan_does_not_write_fails_the_check() -> None:
    # A plan missing the padding fill leaves rows the loader zeroed: not the same bits.
    ws = weights()
    plan = record_plan(meta_model(), specs(ws), load)
    plan.routes["embed"].steps = plan.routes["embed"].steps[:1]
    real = Fused()
    real.load_weights(ws.items())
    problem = check_plan(plan, tensors(real), ws)
    assert problem is not None and "embed" in problem


def test_state_counts_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    ws = weights()
    plan = record_plan(meta_model(), specs(ws), load)
    state = PlanState("test")
    assert state.state == "pending"
    state.adopt(plan, None)
    assert state.state == "verifying"
    info = state.info()
    assert (info["planned"], info["loader"]) == (7, 2)
    routed = {n: r is not None for n, _, r in state.split(ws.items())}
    assert routed["q"] and not routed["scaled"]
    # a tensor in another dtype than recorded goes to the loader
    assert [r for _, _, r in state.split([("q", ws["q"].double())])] == [None]
    state.verified()
    assert state.state == "on"
    monkeypatch.setenv(PLAN_ENV, "off")
    off = PlanState("test")
    assert off.state == "off" and PLAN_ENV in (off.reason or "")


def test_full_copy_destinations() -> None:
    ws = weights()
    plan = record_plan(meta_model(), specs(ws), load)
    assert plan.full_copy("q") is None          # a slice of qkv
    assert plan.full_copy("wt") is None         # transposed source
    assert plan.full_copy("norm") is None       # the copy casts fp32 -> bf16
    assert plan.full_copy("embed") is None      # copy plus a fill
    step = plan.full_copy("plain")
    assert step is not None and step.dest == "plain"


class Split(nn.Module):
    """A fused checkpoint tensor split by the loader into the two halves of a fused
    parameter in another order (phi3's gate_up_proj into vLLM's merged layer), and one
    copied through a temporary (a `clone` first: the loader's own tensor, not a view)."""

    def __init__(self) -> None:
        super().__init__()
        self.merged = nn.Parameter(torch.zeros(8, 4))
        self.via_temp = nn.Parameter(torch.zeros(4))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            if name == "fused":
                up, gate = w.chunk(2, dim=0)
                self.merged.data.narrow(0, 0, 4).copy_(gate)
                self.merged.data.narrow(0, 4, 4).copy_(up)
            elif name == "via_temp":
                tmp = torch.empty_like(w)
                tmp.copy_(w)
                self.via_temp.data.copy_(tmp)


def test_a_split_source_is_planned_and_a_temporary_is_not() -> None:
    ws = {"fused": torch.randn(8, 4), "via_temp": torch.randn(4)}
    with torch.device("meta"):
        skeleton = Split()
    plan = record_plan(skeleton, specs(ws), load)
    assert plan.planned() == ["fused"] and len(plan.routes["fused"].steps) == 2
    assert "copy_" in plan.loader()["via_temp"]
    real = Split()
    real.load_weights(ws.items())
    assert check_plan(plan, tensors(real), ws) is None
    replayed = Split()
    with torch.no_grad():
        replay(plan.routes["fused"], ws["fused"], tensors(replayed))
    assert torch.equal(replayed.merged, real.merged)


def test_only_a_difference_where_the_plan_wrote_turns_it_off() -> None:
    ws = weights()
    state = PlanState("test")
    state.adopt(record_plan(meta_model(), specs(ws), load), None)
    # the loader's part differed (an engine reload bug, repaired by verification)
    state.judge(["experts.w13_weight"], {"qkv", "layers.0.norm.weight"})
    assert state.state == "on"
    state = PlanState("test")
    state.adopt(record_plan(meta_model(), specs(ws), load), None)
    state.judge(["layers.0.norm.weight", "experts.w13_weight"], {"layers.0.norm.weight"})
    assert state.state == "off" and "layers.0.norm.weight" in (state.reason or "")


class Composed(nn.Module):
    """vLLM's `composed_weight_loader` (Mamba2's A from A_log): copy, then
    `param.copy_(-exp(param))` computed from the parameter itself."""

    def __init__(self) -> None:
        super().__init__()
        self.A = nn.Parameter(torch.zeros(4))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _, w in weights:
            self.A.data.copy_(w)
            self.A.data.copy_(-torch.exp(self.A.data.float()))


def test_a_value_computed_from_the_parameter_after_the_copy_stays_on_the_loader() -> None:
    ws = {"A_log": torch.randn(4)}
    with torch.device("meta"):
        skeleton = Composed()
    plan = record_plan(skeleton, specs(ws), load)
    assert plan.planned() == [] and "writes A" in plan.loader()["A_log"]


class Cloned(nn.Module):
    """GPT-OSS's experts in vLLM: a transposed view made contiguous (a clone) before the
    copy (planned, the clone replayed); and a tensor scaled in place (loader)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.zeros(2, 3, 4))
        self.scaled = nn.Parameter(torch.zeros(4))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            if name == "experts":
                t = w.transpose(1, 2).contiguous()
                self.experts.data.copy_(t)
            elif name == "scaled":
                w.mul_(2)
                self.scaled.data.copy_(w)


def test_a_clone_of_a_view_is_replayed_and_an_in_place_change_is_not() -> None:
    ws = {"experts": torch.randn(2, 4, 3), "scaled": torch.randn(4)}
    with torch.device("meta"):
        skeleton = Cloned()
    plan = record_plan(skeleton, specs(ws), load)
    assert plan.planned() == ["experts"] and plan.routes["experts"].steps[0].pre
    assert "in place" in plan.loader()["scaled"]
    real = Cloned()
    real.load_weights({n: t.clone() for n, t in ws.items()}.items())
    assert check_plan(plan, tensors(real), ws) is None
    assert plan.full_copy("experts") is None
