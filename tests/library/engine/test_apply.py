"""The apply routine written once (`engine/apply.py`), through the engine of docs/engines.md.

That engine supplies only its model, loader, skeleton, fresh load and checkpoint folder
(`tests/support/engine_page.py` runs it from the page); everything below is the shared
routine's: the first push goes through the engine's loader and records the copy plan,
checked on the fresh-load shadow; the second is written through the plan, verified bit
for bit against a fresh load, which turns the plan on; the third is planned and not
verified (policy "first"). After each, the engine holds exactly the pushed weights. A
push whose stream breaks after planned tensors were written leaves the engine torn, and
the next push repairs it through the plan. The replica contract suite runs against the
same engine (tests/engines/contract, engine "minimal").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from enginehooks import ReplicaError, WeightSync
from enginehooks.core.manifest import TensorSpec
from enginehooks.engine.apply import ApplyTarget
from enginehooks.trainer_side import TrainerAdapter, adapter_for
from enginehooks_testkit.tiny import load_tiny, perturb
from tests.support.engine_page import PAGE, MinimalEngine, page, page_code


def _assert_holds(engine: MinimalEngine, model: Any) -> None:
    """The engine's parameters are exactly the trainer's checkpoint tensors."""
    params = dict(engine.tiny.model.named_parameters())
    for name, t in adapter_for(model).stream():
        assert torch.equal(params[name], t), name


def _plan(handle: Any) -> dict[str, Any]:
    return handle.info(30)[0]["copy_plan"]  # type: ignore[no-any-return]


def _proved_plan(model_dir: Path) -> tuple[MinimalEngine, Any, Any]:
    """(engine, its `ApplyTarget`, the copy plan) after two pushes: the plan recorded,
    then proved on a fresh load ("on")."""
    engine = MinimalEngine(model_dir)
    handle = engine.handle()
    with WeightSync("gloo", bucket_bytes=16 << 10, timeout_s=60) as sync:
        sync.add_replica(handle)
        for v in (1, 2):  # record the plan, then prove it
            sync.push(perturb(load_tiny(model_dir), seed=v), version=v)
    target = handle.side.target  # type: ignore[attr-defined]
    plan = target.plan.plan
    assert plan is not None and target.plan.state == "on"
    return engine, target, plan


def test_the_page_runs_as_written() -> None:
    """Every part the page promises is defined by its own code, at its own lines."""
    assert issubclass(page.TinyTarget, ApplyTarget)
    assert {"TinyEngine", "TinyTarget", "TinyBinding", "TinyHandle", "weight_label"} <= set(vars(page))
    text = PAGE.read_text()
    code = page_code(text).splitlines()
    line = next(i for i, t in enumerate(text.splitlines()) if t.startswith("class TinyTarget"))
    assert code[line].startswith("class TinyTarget") and len(code) == len(text.splitlines())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_copy_plan_is_recorded_proved_and_used(model_dirs: dict[str, Path], arch: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # policy "first" (the opt-out): what it verifies; "always" (the default) is
    # tests/unit/test_verify_every_update.py's
    monkeypatch.setenv("ENGINEHOOKS_VERIFY", "first")
    monkeypatch.delenv("ENGINEHOOKS_COPY_PLAN", raising=False)
    engine = MinimalEngine(model_dirs[arch])
    handle = engine.handle()
    with WeightSync("gloo", bucket_bytes=16 << 10, timeout_s=60) as sync:
        sync.add_replica(handle)
        first = perturb(load_tiny(model_dirs[arch]), seed=1)
        sync.push(first, version=1)
        _assert_holds(engine, first)
        plan, verification = _plan(handle), handle.info(30)[0]["verification"]
        assert plan["state"] == "verifying", plan
        total = len(list(adapter_for(first).specs()))
        assert plan["planned"] == total and plan["loader"] == 0, plan  # all plain copies
        assert plan["applied"] == 0 and plan["planned_last"] == 0, plan
        assert plan["loader_last"] == total, plan
        assert verification["verified"] == 1 and verification["last"]["ok"] is True

        second = perturb(load_tiny(model_dirs[arch]), seed=2)
        sync.push(second, version=2)
        _assert_holds(engine, second)
        plan, verification = _plan(handle), handle.info(30)[0]["verification"]
        assert plan["state"] == "on", plan
        assert plan["applied"] == 1 and plan["planned_last"] == total, plan
        assert plan["loader_last"] == 0, plan
        # the first update through the plan is verified whatever the policy says
        assert verification["verified"] == 2, verification
        assert verification["last"]["ok"] is True and verification["last"]["mismatched"] == []

        third = perturb(load_tiny(model_dirs[arch]), seed=3)
        sync.push(third, version=3)
        _assert_holds(engine, third)
        assert _plan(handle)["applied"] == 2
        assert handle.info(30)[0]["verification"]["verified"] == 2  # policy "first"
    assert handle.version() == 3
    assert {g.version for g in engine.generate()} == {"3"}
    engine.close()


class BreaksLate(TrainerAdapter):
    """A trainer whose stream fails after most tensors went out."""

    name = "breaks-late"

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.inner = adapter_for(model)

    @classmethod
    def accepts(cls, model: Any) -> bool:
        return False

    def specs(self) -> list[TensorSpec]:
        return self.inner.specs()

    def stream(self) -> Any:
        items = list(self.inner.stream())
        for i, item in enumerate(items):
            if i == len(items) - 2:
                raise RuntimeError("trainer rank lost its shard")
            yield item


def test_a_broken_planned_push_tears_and_the_next_repairs(model_dirs: dict[str, Path]) -> None:
    engine = MinimalEngine(model_dirs["llama"])
    handle = engine.handle()
    with WeightSync("gloo", bucket_bytes=16 << 10, timeout_s=30) as sync:
        sync.add_replica(handle)
        for seed in (4, 5):
            sync.push(perturb(load_tiny(model_dirs["llama"]), seed=seed), version=seed)
        assert _plan(handle)["state"] == "on"
        with pytest.raises((RuntimeError, ReplicaError), match="lost its shard"):
            sync.push(BreaksLate(perturb(load_tiny(model_dirs["llama"]), seed=6)), version=6)
        assert handle.info(30)[0]["state"] == "torn"
        last = perturb(load_tiny(model_dirs["llama"]), seed=7)
        sync.push(last, version=7)
    _assert_holds(engine, last)
    plan = _plan(handle)
    assert plan["state"] == "on" and plan["applied"] == 2, plan
    assert handle.info(30)[0]["state"] == "current"
    engine.close()


def test_a_destination_is_handed_out_again_only_while_its_tensor_is_where_it_was(
        model_dirs: dict[str, Path]) -> None:
    """`ApplyTarget.destination` keeps its answer per destination between updates (its
    check against the plan's layout costs microseconds a tensor: milliseconds for a
    MoE's thousands). The same answer comes back only for the same tensor object at the
    same address, shape, strides and dtype; a tensor re-pointed, reshaped or
    reinterpreted in place is checked again (protective lines: each comparison in
    `destination`)."""
    from enginehooks.engine.walk import live_tensors

    engine, target, plan = _proved_plan(model_dirs["llama"])
    name = next(n for n in plan.routes if plan.full_copy(n) is not None
                and len(plan.layouts[plan.full_copy(n).dest].sizes) == 2)
    dest = plan.full_copy(name).dest

    def ask() -> torch.Tensor | None:
        target.routes = {name: plan.routes[name]}
        target.live = live_tensors(target.model())
        return target.destination(name)  # type: ignore[no-any-return]

    try:
        a = ask()
        assert a is not None and ask() is a  # the same answer, kept
        t = target.live[dest]
        t.requires_grad_(False)  # (a served model's are; `.data` may then change dtype)
        t.data = t.data.clone()  # re-pointed: the same object elsewhere
        b = ask()
        assert b is not None and b is not a and b.data_ptr() == t.data_ptr()
        was = t.data
        t.data = was.view(torch.int32)  # the same address and shape, another dtype
        assert ask() is None
        t.data = was.view(-1)  # the same address, another shape
        assert ask() is None
        t.data = was
        c = ask()
        assert c is not None and c.dtype == was.dtype and c.data_ptr() == was.data_ptr()
    finally:
        target.routes, target.live = {}, None
        engine.close()


def test_the_writable_routes_are_kept_only_while_every_destination_holds(
        model_dirs: dict[str, Path]) -> None:
    """`ApplyTarget.writable` keeps its answer for the next update (a `Layout` per
    destination costs ~2.6 us, thousands a MoE push). The kept answer comes back only
    for the same routes into the same tensor objects at the same address, shape,
    strides and dtype; a destination reshaped in place is checked again, and its route
    goes to the loader (protective line: the keys compared in `_Writable.holds`)."""
    engine, target, plan = _proved_plan(model_dirs["llama"])
    offered = {n: r for n, r in plan.routes.items() if r.planned}
    name = next(n for n in offered if plan.full_copy(n) is not None)
    dest = plan.full_copy(name).dest
    try:
        first = target.writable(dict(offered))
        assert name in first and target.writable(dict(offered)) is first  # kept
        t = target.live[dest]
        t.requires_grad_(False)
        was = t.data
        t.data = was.view(-1)  # the same object and address, another shape
        reshaped = target.writable(dict(offered))
        assert name not in reshaped and set(first) - set(reshaped) == {name}
        t.data = was
        again = target.writable(dict(offered))
        assert again is not first and set(again) == set(first)
        fewer = dict(offered)
        fewer.pop(name)
        assert name not in target.writable(fewer)  # other routes: answered anew
    finally:
        target.routes, target.live = {}, None
        engine.close()
