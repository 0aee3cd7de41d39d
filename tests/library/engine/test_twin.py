"""Post-load processing on a fresh twin of a layer (`engine.twin`), on a small torch model
whose processing does what vLLM CPU's does to a linear layer: it packs the weight into a
new tensor a closure captures (`cpu_linear`, the forward's only reader) and empties the
weight parameter. No engine is needed for the mechanics; `tests/vllm/
test_verify_every_update.py` runs the same with `ENGINEHOOKS_TWIN=on` in a real vLLM."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from enginehooks.engine.twin import TWIN_ENV, TwinLayers, movable, twin_mode
from enginehooks.engine.verify import Verdict, compare


class Packing:
    """A quant method: `process_weights_after_loading` as vLLM CPU's for a linear."""

    def __init__(self, fault: str = "") -> None:
        self.fault = fault

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if self.fault == "raise":
            raise RuntimeError("no kernel for this shape")
        packed = layer.weight.detach().t().contiguous() * 1.0
        if self.fault == "bound":
            layer.cpu_linear = layer.forward  # serves from the module it was made on
        elif self.fault == "captures_param":  # reads a tensor the twin holds after
            kept = torch.nn.Parameter(packed, requires_grad=False)
            layer.packed_weight = kept
            layer.cpu_linear = lambda x: x @ kept
        else:
            layer.cpu_linear = lambda x: x @ packed
        layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        layer.processed = True


class Linear(torch.nn.Module):
    def __init__(self, n: int, fault: str = "") -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(n, n), requires_grad=False)
        self.quant_method = Packing(fault)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cpu_linear(x)  # type: ignore[no-any-return, operator]


class Model(torch.nn.Module):
    def __init__(self, fault: str = "", shared: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Linear(8), Linear(8, fault)])
        self.rotary = shared if shared is not None else torch.nn.Identity()


def _run(layer: torch.nn.Module) -> None:
    layer.quant_method.process_weights_after_loading(layer)  # type: ignore[union-attr, operator]


def _live(fault: str = "") -> Model:
    """The engine's live model, processed once at start."""
    live = Model(fault)
    for layer in live.layers:
        _run(layer)
    return live


def _reloading(layer: torch.nn.Module, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The live layer as an update leaves it before processing: its loader-layout
    weight back (vLLM's `restore_layer_on_meta` + `materialize_layer`), holding `w`.
    Returns its kernel tensors (what it held processed), for `_finish`."""
    kernel = dict(layer._parameters)
    layer._parameters.clear()
    layer.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    return kernel


def _finish(layer: torch.nn.Module, kernel: dict[str, torch.Tensor]) -> None:
    """What vLLM does after processing a layer (`_copy_and_restore_kernel_tensors`):
    the processed values copied into the kernel tensors, which are put back."""
    with torch.no_grad():
        for name, p in kernel.items():
            p.data.copy_(getattr(layer, name))
    layer._parameters.clear()
    layer._parameters.update(kernel)


def test_a_layer_processed_on_its_twin_serves_the_twins_products() -> None:
    live = _live()
    twins = TwinLayers(lambda: Model(shared=live.rotary), live)
    w = torch.randn(8, 8)
    layer = live.layers[0]
    kernel = _reloading(layer, w)
    handed = layer.weight
    assert twins.process("layers.0", layer, _run)
    assert twins.moved == {"layers.0"} and twins.processed() == {"layers.0"}
    twin = twins.modules["layers.0"]
    # the live layer holds what processing the twin produced (the same objects) and
    # was given the live layer's own loader-layout bytes (handed over, not copied)
    assert layer.cpu_linear is twin.cpu_linear and layer.processed is True
    assert layer.weight is twin.weight and layer.weight.numel() == 0
    assert handed.data_ptr() != 0 and handed is not twin.weight
    _finish(layer, kernel)
    x = torch.randn(3, 8)
    assert torch.equal(layer(x), x @ (w.t().contiguous() * 1.0))
    # the check against the twin: the moved callable is equal by identity, no probe run
    verdict = Verdict()
    assert compare(live, twins.model, {"layers.0.weight"}, verdict, (), {"layers.0"}) == []
    assert "layers.0.cpu_linear<packed>" not in verdict.unverified
    # a change after the move is still found: the live callable replaced by another
    packed = w.t().contiguous() * 2.0
    layer.cpu_linear = lambda x: x @ packed
    verdict = Verdict()
    found = compare(live, twins.model, {"layers.0.weight"}, verdict, (), {"layers.0"})
    assert [m.name for m in found] == ["layers.0.cpu_linear<packed>"], found


@pytest.mark.parametrize("fault", ["bound", "captures_param"])
def test_a_product_reaching_the_twin_is_not_moved(fault: str) -> None:
    live = _live(fault)
    twins = TwinLayers(lambda: Model(fault, shared=live.rotary), live)
    layer = live.layers[1]
    old = layer.cpu_linear
    _reloading(layer, torch.randn(8, 8))
    assert not twins.process("layers.1", layer, _run)
    # processed on the twin (its fresh load, for the check) but served by the live
    # layer's own processing: nothing of the twin's was moved into it
    assert twins.kept_live == {"layers.1"} and "layers.1" in twins.processed()
    assert layer.cpu_linear is old and layer.weight.numel() == 64
    assert "packed_weight" not in layer._parameters


def test_a_twin_whose_processing_fails_is_never_compared_against() -> None:
    live = _live()
    twins = TwinLayers(lambda: Model("raise", shared=live.rotary), live)
    layer = live.layers[1]
    _reloading(layer, torch.randn(8, 8))
    assert not twins.process("layers.1", layer, _run)
    assert twins.processed() == set() and "layers.1" not in twins.modules


def test_a_twin_that_cannot_be_handed_the_live_tensors_is_not_used() -> None:
    """A twin parameter something else holds (a view of it made at construction, as
    vLLM's Mamba mixers alias their conv weight) cannot be swapped in place: that layer
    processes itself, its twin is never compared against, the update goes on."""
    class Aliasing(Model):
        def __init__(self) -> None:
            super().__init__()
            self.layers[1].alias = self.layers[1].weight.view(-1)

    live = _live()
    twins = TwinLayers(Aliasing, live)
    layer = live.layers[1]
    _reloading(layer, torch.randn(8, 8))
    before = dict(vars(layer))
    assert not twins.process("layers.1", layer, _run)
    assert twins.refused["layers.1"].startswith("hand-over failed")
    assert twins.processed() == set() and "layers.1" not in twins.modules
    assert vars(layer) == before  # nothing moved into the live layer
    _reloading(live.layers[0], torch.randn(8, 8))
    assert twins.process("layers.0", live.layers[0], _run)  # the other layers still are


def test_a_twin_of_another_class_or_layout_is_not_used() -> None:
    live = _live()
    twins = TwinLayers(lambda: Model(shared=live.rotary), live)
    layer = live.layers[0]
    layer.weight = torch.nn.Parameter(torch.zeros(4, 8), requires_grad=False)  # not 8x8
    assert not twins.process("layers.0", layer, _run)
    assert not twins.process("rotary", live.rotary, _run)
    assert twins.processed() == set()


def test_a_tied_layer_takes_the_processed_owner_and_moves_only_what_is_not_a_tensor() -> None:
    class Head(torch.nn.Module):
        def __init__(self, owner: Linear) -> None:
            super().__init__()
            self.weight = owner.weight  # tied: every tensor of it is the owner's
            self.quant_method = Packing()

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = Linear(8)
            self.embed.quant_method = Keep()
            self.head = Head(self.embed)

    class Keep(Packing):
        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            layer.kept = True  # leaves the weight (an embedding keeps it)

    class KeepAll(Packing):  # the head's packing, leaving the weight (the owner's)
        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            packed = layer.weight.detach().t().contiguous() * 1.0
            layer.cpu_linear = lambda x: x @ packed

    def build() -> Tied:
        m = Tied()
        m.head.quant_method = KeepAll()
        return m

    live = build()
    twins = TwinLayers(build, live)
    w = torch.randn(8, 8)
    # the head first: its owner's twin was not processed, so nothing is handed over
    assert not twins.process("head", live.head, _run, tied=True)
    kernel = _reloading(live.embed, w)
    assert twins.process("embed", live.embed, _run)
    _finish(live.embed, kernel)
    assert twins.process("head", live.head, _run, tied=True)
    # the head's own tensor stays the live owner's; its packed callable is the twin's
    assert live.head.weight is live.embed.weight
    assert live.head.cpu_linear is twins.modules["head"].cpu_linear
    x = torch.randn(2, 8)
    assert torch.equal(live.head.cpu_linear(x), x @ (w.t().contiguous() * 1.0))


def test_movable_refuses_whatever_would_serve_from_the_twin() -> None:
    twin = torch.nn.Linear(2, 2)
    mine = torch.ones(2)
    owned = {id(twin.weight)}

    class Handle:  # an engine's packed handle
        def __init__(self, held: Any) -> None:
            self.held = held

    assert movable(mine, owned) and movable(3) and movable(torch.float32) and movable(None)
    assert movable(lambda x: x + mine, owned) and movable(Handle(mine), owned)
    assert movable(functools.partial(torch.add, other=mine), owned)
    assert movable(Handle(torch.ops.aten.add), owned)  # (vLLM's handle holds its destructor)
    assert not movable(twin.weight, owned)
    assert not movable(lambda x: twin.weight @ x, owned)
    assert not movable(twin) and not movable(twin.forward)
    assert not movable(lambda x: twin(x))
    assert not movable(functools.partial(twin.forward))
    assert not movable(Handle(twin)) and not movable(Handle([twin.weight]), owned)
    assert not movable({"w": twin.weight}, owned)


def test_dropping_the_twins_leaves_the_modules_the_engine_shares() -> None:
    shared = torch.nn.Linear(2, 2)
    shared.cached = lambda x: x  # (an engine's cached callable on a shared module)
    live = _live()
    live.rotary = shared
    twins = TwinLayers(lambda: Model(shared=shared), live)
    kernel = _reloading(live.layers[0], torch.randn(8, 8))
    assert twins.process("layers.0", live.layers[0], _run)
    _finish(live.layers[0], kernel)
    twins.drop()
    assert twins.model is None and twins.modules == {}
    assert shared.weight is not None and callable(shared.cached)
    x = torch.randn(1, 8)
    assert live.layers[0](x).shape == (1, 8)  # the moved products outlive the twins


def test_a_tensor_held_wider_than_the_twins_is_cast_back_only_where_exact() -> None:
    """vLLM CPU restores a small linear's bias in float32 on AMX hosts, where the fresh
    model holds it in bf16: the twin takes it cast back only where every value survives
    the round trip (then it is what the fresh load's loader wrote); a value that would
    round is refused, never handed over altered."""
    def build() -> Model:
        m = Model()
        for layer in m.layers:
            layer.weight.data = layer.weight.data.to(torch.bfloat16)
        return m

    live = _live()  # float32, as restored wider
    twins = TwinLayers(build, live)
    exact = torch.randn(8, 8).to(torch.bfloat16).to(torch.float32)
    kernel = _reloading(live.layers[0], exact)
    assert twins.process("layers.0", live.layers[0], _run)
    _finish(live.layers[0], kernel)
    x = torch.randn(2, 8).to(torch.bfloat16)
    assert torch.equal(live.layers[0](x), x @ (exact.to(torch.bfloat16).t().contiguous() * 1.0))
    _reloading(live.layers[1], exact + 1e-3)  # bf16 cannot hold these
    assert not twins.process("layers.1", live.layers[1], _run)
    assert "layout" in twins.refused["layers.1"] and "layers.1" not in twins.processed()


def test_twins_are_on_by_default_and_a_bad_setting_turns_them_off(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(TWIN_ENV, raising=False)
    assert twin_mode() == "on"
    monkeypatch.setenv(TWIN_ENV, " OFF ")
    assert twin_mode() == "off"
    monkeypatch.setenv(TWIN_ENV, "yes-please")
    with caplog.at_level("WARNING", logger="enginehooks.verify"):
        assert twin_mode() == "off"
    assert "ENGINEHOOKS_TWIN='yes-please' is not one of on/off" in caplog.text
