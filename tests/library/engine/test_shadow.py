"""The streamed shadow (`engine.shadow`): one unit at a time, as strict as a whole one.

A small engine-like model in plain torch: a list of layers, each a linear whose
post-load processing derives a packed copy of its weight (as vLLM's CPU linears hold a
prepacked one), parameters carrying a `weight_loader` bound to their module (as vLLM's
do: a reference cycle), and a rotary-like module shared with the live model (as vLLM's
cached rotary embedding is). The live model is verified with the shadow streamed and
with it whole: the verdicts agree, the streamed one never holds more than one unit, and
a packed copy corrupted in the live model is repaired from either.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import pytest
import torch

from enginehooks.engine import shadow
from enginehooks.engine.shadow import ShadowParts, construct, stream
from enginehooks.engine.verify import readable_tensors, verify_and_repair

HIDDEN, LAYERS = 64, 6
SHARED: dict[str, torch.nn.Module] = {}


class Rotary(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.arange(32.0))
        self.scale = torch.nn.Parameter(torch.full((4,), 3.0), requires_grad=False)


def rotary() -> torch.nn.Module:
    """One instance for every model built (the engine caches it, like vLLM's get_rope)."""
    if "r" not in SHARED:
        SHARED["r"] = Rotary()
    return SHARED["r"]


rotary()  # built for real before any shadow, as an engine's live model is built first


class Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        weight = torch.nn.Parameter(torch.empty(HIDDEN, HIDDEN), requires_grad=False)
        self.register_parameter("weight", weight)
        # set on the object after registering it, as vLLM's and SGLang's linears do
        weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: torch.Tensor, w: torch.Tensor) -> None:
        param.data.copy_(w)

    def process(self) -> None:
        self.packed = (self.weight.t() * 1).contiguous()  # derived: what the loader computes


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = Linear()
        self.rotary = rotary()


class Model(torch.nn.Module):
    def __init__(self, tied_layer: bool = False) -> None:
        super().__init__()
        self.embed = Linear()
        self.layers = torch.nn.ModuleList(Layer() for _ in range(LAYERS))
        self.head = Linear()
        self.head.weight = self.embed.weight  # tied: loaded through the embedding only
        if tied_layer:
            self.layers[1].proj.weight = self.embed.weight

    def load_weights(self, weights: Any) -> None:
        params = dict(self.named_parameters())
        for name, w in weights:
            p = params[name]
            p.weight_loader(p, w)

    def process(self) -> None:
        for m in self.modules():
            if isinstance(m, Linear):
                m.process()


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    names = ["embed.weight"] + [f"layers.{i}.proj.weight" for i in range(LAYERS)]
    return [(n, torch.randn(HIDDEN, HIDDEN, generator=g)) for n in names]


def _live(weights: list[tuple[str, torch.Tensor]], **kw: Any) -> Model:
    m = Model(**kw)
    with torch.no_grad():
        m.load_weights(iter(weights))
    m.process()
    return m


def _whole(weights: list[tuple[str, torch.Tensor]], **kw: Any) -> Model:
    return _live(weights, **kw)


def _parts(lands: Mapping[str, Collection[str] | None] | None = None, log: Any = None,
           **kw: Any) -> ShadowParts:
    def load(model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            model.load_weights(iter(weights))  # type: ignore[operator]

    def process(model: torch.nn.Module) -> None:
        model.process()  # type: ignore[operator]
        if log is not None:
            log(model)

    def where(weights: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        return {n: (lands[n] if lands is not None and n in lands else {n}) for n, _ in weights}

    return ShadowParts(lambda: Model(**kw), load, process, where, torch.device("cpu"))


def _verify(live: Model, weights: list[tuple[str, torch.Tensor]], parts: ShadowParts | None,
            **kw: Any) -> Any:
    landed = {n for n, _ in weights}
    streamer = ((lambda needed: stream(parts, weights, live, needed, readable_tensors))
                if parts else None)
    return verify_and_repair(live, lambda: _whole(weights, **kw), landed, engine="tiny",
                             stream_fresh=streamer)


def test_construct_holds_no_real_parameter() -> None:
    model = construct(Model)
    shared = SHARED["r"].scale
    assert all(p.is_meta for p in model.parameters() if p is not shared)
    assert not shared.is_meta  # the live model's (cached) module is left alone
    # the parameter's own attributes survive (its loader), buffers stay as constructed
    assert callable(model.embed.weight.weight_loader)  # type: ignore[attr-defined]
    assert torch.equal(model.layers[0].rotary.cache, torch.arange(32.0))


def test_streamed_agrees_with_whole_and_holds_one_unit() -> None:
    w = _weights(1)
    seen: list[int] = []
    live = _live(w)
    v = _verify(live, w, _parts(log=lambda m: seen.append(shadow.held_bytes(m))))
    whole = _verify(_live(w), w, None)
    assert v.shadow_kind == "streamed" and whole.shadow_kind == "whole"
    assert v.shadow_units == LAYERS + 1  # every layer, then the rest (embed)
    assert not v.mismatched and not whole.mismatched
    assert v.compared == whole.compared and v.probed == whole.probed
    layer = HIDDEN * HIDDEN * 4
    # one unit's weight (and its packed copy) at a time, the shared rotary cache aside
    shared = 32 * 4 + 4 * 4
    assert max(seen) <= layer + shared
    assert v.shadow_tensor_bytes <= 2 * layer + shared
    assert whole.shadow_tensor_bytes >= (LAYERS + 1) * layer
    # the module the live model shares with the shadow is left whole
    assert torch.equal(live.layers[0].rotary.cache, torch.arange(32.0))
    assert torch.equal(live.layers[0].rotary.scale, torch.full((4,), 3.0))


def test_units_are_released_before_the_next() -> None:
    w = _weights(2)
    refs: list[weakref.ref[torch.Tensor]] = []
    alive: list[int] = []

    def log(model: torch.nn.Module) -> None:
        gc.disable()  # what is freed must be freed without the collector
        alive.append(sum(r() is not None for r in refs))
        refs.extend(weakref.ref(p) for p in model.parameters()
                    if not p.is_meta and p is not SHARED["r"].scale)

    try:
        _verify(_live(w), w, _parts(log=log))
    finally:
        gc.enable()
    assert alive == [0] * (LAYERS + 1)


def test_a_corrupted_packed_copy_is_repaired_from_its_unit() -> None:
    w = _weights(3)
    live = _live(w)
    good = live.layers[3].proj.packed.clone()
    live.layers[3].proj.packed.mul_(2.0)  # post-load processing run twice
    v = _verify(live, w, _parts())
    assert v.shadow_kind == "streamed"
    assert v.mismatched == ["layers.3.proj.packed"] == v.repaired
    assert torch.equal(live.layers[3].proj.packed, good)


def test_only_units_with_a_module_left_to_the_shadow_are_built() -> None:
    w = _weights(4)
    live = _live(w)
    built: list[int] = []
    parts = _parts(log=lambda m: built.append(1))
    passes = list(stream(parts, w, live, {"layers.2.proj", "layers.2"}, readable_tensors))
    assert [p.unit for p in passes] == ["layers.2"] and len(built) == 1


@pytest.mark.parametrize("case", ["unknown landing", "two units", "tied across units",
                                  "ancestor holds a tensor"])
def test_what_cannot_stream_exactly_is_built_whole(case: str) -> None:
    w = _weights(5)
    kw: dict[str, Any] = {"tied_layer": True} if case == "tied across units" else {}
    lands: dict[str, Any] = {}
    if case == "unknown landing":
        lands["layers.0.proj.weight"] = None
    if case == "two units":
        lands["layers.0.proj.weight"] = {"layers.0.proj.weight", "layers.1.proj.weight"}
    if case == "tied across units":
        w = [(n, t) for n, t in w if n != "layers.1.proj.weight"]
    live = _live(w, **kw)
    if case == "ancestor holds a tensor":
        live.cross_layer = torch.ones(2)  # derived across layers: a unit alone cannot give it
    live.layers[4].proj.packed.add_(1.0)
    v = _verify(live, w, _parts(lands, **kw), **kw)
    assert v.shadow_kind == "whole"
    assert v.mismatched == ["layers.4.proj.packed"] == v.repaired


def test_a_failing_stream_falls_back_to_whole_keeping_its_repairs() -> None:
    w = _weights(6)
    live = _live(w)
    live.layers[0].proj.packed.add_(1.0)
    live.embed.packed.add_(1.0)
    calls = {"n": 0}

    def log(model: torch.nn.Module) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("the engine's processing failed on a partial tree")

    v = _verify(live, w, _parts(log=log))
    assert v.shadow_kind == "whole"
    assert v.mismatched == ["layers.0.proj.packed", "embed.packed"]
    assert torch.equal(live.embed.packed, (live.embed.weight.t() * 1).contiguous())


def test_env_whole_builds_it_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINEHOOKS_SHADOW", "whole")
    w = _weights(7)
    assert _verify(_live(w), w, _parts()).shadow_kind == "whole"


@pytest.mark.parametrize("case", ["unknown landing", "nowhere", "two units"])
def test_an_update_tensor_not_in_exactly_one_unit_is_unstreamable(case: str) -> None:
    w = _weights(8)
    lands: dict[str, Any] = {"layers.0.proj.weight": {
        "unknown landing": None, "nowhere": set(),
        "two units": {"layers.0.proj.weight", "layers.1.proj.weight"}}[case]}
    with pytest.raises(shadow.Unstreamable, match=r"layers\.0\.proj\.weight lands in"):
        list(stream(_parts(lands), w, _live(w), {"layers.0.proj"}, readable_tensors))


def test_what_a_unit_cannot_repair_is_torn_without_a_whole_shadow() -> None:
    from enginehooks.engine.verify import WeightsMismatch

    w = _weights(9)
    live = _live(w)
    # another shape: no copy repairs it
    live.layers[2].proj.weight = torch.nn.Parameter(torch.zeros(3), requires_grad=False)

    def whole() -> torch.nn.Module:
        raise AssertionError("the whole shadow is not built once a unit proved a tear")

    parts = _parts()
    with pytest.raises(WeightsMismatch, match=r"layers\.2\.proj\.weight \(shape\)"):
        verify_and_repair(live, whole, {n for n, _ in w}, engine="tiny",
                          stream_fresh=lambda needed: stream(parts, w, live, needed,
                                                             readable_tensors))


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("bad_unit", [None, "layers.4.proj.weight"])
def test_the_copy_plans_first_check_runs_unit_by_unit(
        monkeypatch: pytest.MonkeyPatch, verify: bool, bad_unit: str | None) -> None:
    """The plan is checked before each unit's processing, on that unit's tensors (the
    check itself, `check_plan`, is replaced by a recorder here: what is tested is that
    every unit is checked and one unit's problem keeps the plan off)."""
    from enginehooks.engine import copy_plan
    from enginehooks.engine.verify import Verifier

    w = _weights(10)
    live = _live(w)
    checked: list[str] = []

    def check(plan: Any, loaded: Mapping[str, torch.Tensor],
              weights: Mapping[str, torch.Tensor]) -> str | None:
        for name, t in weights.items():
            checked.append(name)
            assert torch.equal(loaded[name], t)  # what the loader alone wrote, real
        return f"{bad_unit} differs" if bad_unit in weights else None

    monkeypatch.setattr(copy_plan, "check_plan", check)
    plan = copy_plan.CopyPlan.__new__(copy_plan.CopyPlan)
    monkeypatch.setattr(copy_plan.CopyPlan, "planned", lambda self: {"x": 1})
    monkeypatch.setattr(copy_plan.CopyPlan, "loader", lambda self: {})
    plan.global_reason = None
    state = copy_plan.PlanState("tiny")
    parts = _parts()

    def whole(hook: Any) -> torch.nn.Module:
        raise AssertionError("the whole shadow is not built where it streams")

    state.check_on_shadow(plan, Verifier("tiny"), live, whole, dict(w), {n for n, _ in w},
                          verify, lambda needed, hook: stream(parts, w, live, needed,
                                                              readable_tensors, hook))
    assert sorted(checked) == sorted(n for n, _ in w)
    assert state.state == ("verifying" if bad_unit is None else "off"), state.reason


# -- the collection after a streamed shadow (`shadow._collect_if_held`) --------------------
def test_a_full_collection_runs_only_where_it_can_free_what_the_shadow_dropped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After a streamed shadow the dropped tensors are collected only where one is still
    alive: a tensor held by a reference cycle is freed by the collection; one that
    something live holds (a tied weight) survives it, and while the same ones survive,
    later shadows of that model class skip the collection (~0.4 s a push in a vLLM
    worker, freeing nothing); a different set alive is collected again. gc.collect is
    wrapped only to count its calls (it still runs). Protective line: the collection
    itself (without it the tensor in a cycle stays alive)."""
    calls: list[int] = []
    real = gc.collect
    monkeypatch.setattr(shadow.gc, "collect", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(shadow, "_UNFREED", {})

    class Model(torch.nn.Module):
        pass

    def cycle() -> weakref.ref[torch.Tensor]:
        t = torch.zeros(8)
        holder: dict[str, object] = {"t": t}
        holder["self"] = holder  # a reference cycle holds the tensor
        return weakref.ref(t)

    freed = torch.zeros(4)
    released = [weakref.ref(freed)]
    del freed
    assert shadow._collect_if_held(released, Model) is False and calls == []  # all freed

    gc.disable()  # no automatic collection between the drop and the check
    try:
        released = [cycle()]
        assert released[0]() is not None
        assert shadow._collect_if_held(released, Model) is True and len(calls) == 1
        assert released[0]() is None  # the cycle was collected
        tied = torch.ones(3, 2)  # something live holds it
        released = [weakref.ref(tied)]
        assert shadow._collect_if_held(released, Model) is True and len(calls) == 2
        assert shadow._collect_if_held(released, Model) is False and len(calls) == 2
        released = [weakref.ref(tied), cycle()]  # another set alive: collected again
        assert shadow._collect_if_held(released, Model) is True and len(calls) == 3
        assert released[1]() is None
    finally:
        gc.enable()
