"""Tests that kill the mutants `make mutants` found surviving in the protective functions of
engine/copy_plan.py (docs/testing.md): `check_plan` (the bit-for-bit proof of a plan
against the loader), `coverage` (when a replay may start from an uninitialised
destination), and `PlanState`'s verdicts (`adopt`, `disable`, `judge`, `check_on_shadow`,
`verify_update`), which decide whether the engine keeps writing through the plan.

The engines run these on their workers (tests/vllm, tests/sglang), in subprocesses
mutmut cannot see; here the same functions run in process on the small torch modules of
tests/library/engine/test_copy_plan.py, with a real `Verifier` and real fresh loads."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import pytest
import torch
from torch import nn

from enginehooks.core.manifest import TensorSpec
from enginehooks.engine.copy_plan import (
    CopyPlan,
    Layout,
    PlanState,
    Route,
    Step,
    View,
    check_plan,
    coverage,
    record_plan,
)
from enginehooks.engine.verify import Verifier, WeightsMismatch
from tests.library.engine.test_copy_plan import Fused, load, meta_model, specs, tensors, weights

LOGGER = "enginehooks.copy_plan"


def recorded() -> tuple[CopyPlan, dict[str, torch.Tensor]]:
    ws = weights()
    return record_plan(meta_model(), specs(ws), load), ws


def loaded(ws: dict[str, torch.Tensor], scale: float = 2.0) -> Fused:
    m = Fused(scale=scale)
    m.load_weights(ws.items())
    return m


# -- check_plan -------------------------------------------------------------------------


def test_a_tensor_absent_from_the_update_is_skipped_and_the_rest_still_checked() -> None:
    # q, k, v (the first planned tensors) are not in this update; "plain" is, and the
    # loaded model holds something else in it: the check must go on past them and refuse.
    plan, ws = recorded()
    model = tensors(loaded(ws))
    model["plain"] = model["plain"] + 1
    part = {n: t for n, t in ws.items() if n not in ("q", "k", "v")}
    assert check_plan(plan, model, part) == (
        "replaying ['plain'] into plain does not give what the loader wrote (bits differ)")


def test_a_destination_in_another_layout_than_recorded_is_refused_naming_both() -> None:
    # Same values, another dtype: the bits of a float64 scratch and a float64 loaded tensor
    # would agree, so only the layout check tells that this is not the recorded tensor.
    plan, ws = recorded()
    model = tensors(loaded(ws))
    model["plain"] = model["plain"].double()
    assert check_plan(plan, model, ws) == (
        "plain: its layout Layout(sizes=(3, 3), strides=(3, 1), dtype=torch.float64) differs "
        "from the recorded Layout(sizes=(3, 3), strides=(3, 1), dtype=torch.float32)")


class Rows(nn.Module):
    """Five tensors loaded into the five rows of one fused parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = nn.Parameter(torch.zeros(5, 3))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            self.fused.data[int(name[1:])].copy_(w)


def test_a_refusal_names_the_first_three_tensors_of_the_destination() -> None:
    ws = {f"r{i}": torch.randn(3) for i in range(5)}
    with torch.device("meta"):
        skeleton = Rows()
    plan = record_plan(skeleton, specs(ws), load)
    assert plan.planned() == ["r0", "r1", "r2", "r3", "r4"]
    real = Rows()
    real.load_weights(ws.items())
    assert check_plan(plan, tensors(real), ws) is None
    assert check_plan(plan, {"fused": real.fused.data * 2}, ws) == (
        "replaying ['r0', 'r1', 'r2'] into fused does not give what the loader wrote "
        "(bits differ)")


# -- coverage ---------------------------------------------------------------------------


def _spec(name: str, *shape: int) -> TensorSpec:
    return TensorSpec(name, "float32", shape)


def test_coverage_of_strided_and_unrecorded_destinations_is_false_for_each() -> None:
    # A column of a matrix (not one contiguous run), twice, and a destination whose layout
    # was not recorded: each is False, and each is in the answer.
    col = View(0, (3,), (3,))
    plan = CopyPlan(routes={
        "c0": Route(_spec("c0", 3), [Step("a", col, View(0, (3,), (1,)))]),
        "c1": Route(_spec("c1", 3), [Step("b", col, View(0, (3,), (1,)))]),
        "u": Route(_spec("u", 3), [Step("c", View(0, (3,), (1,)), View(0, (3,), (1,)))]),
    }, layouts={"a": Layout((3, 3), (3, 1), torch.float32),
                "b": Layout((3, 3), (3, 1), torch.float32)})
    assert coverage(plan, ["c0", "c1", "u"]) == {"a": False, "b": False, "c": False}
    assert coverage(plan, ["c0", "c1"]) == {"a": False, "b": False}


def test_coverage_needs_every_element_written_exactly_once() -> None:
    full = View(0, (3, 3), (3, 1))
    lay = {"d": Layout((3, 3), (3, 1), torch.float32)}

    def plan(*views: View) -> CopyPlan:
        return CopyPlan(routes={f"t{i}": Route(_spec(f"t{i}", 9), [Step("d", v, full)])
                                for i, v in enumerate(views)}, layouts=lay)

    whole = plan(full)
    assert coverage(whole, ["t0"]) == {"d": True}
    twice = plan(full, full)                     # the same elements written twice
    assert coverage(twice, ["t0", "t1"]) == {"d": False}
    halves = plan(View(0, (5,), (1,)), View(5, (4,), (1,)))
    assert coverage(halves, ["t0", "t1"]) == {"d": True}
    gap = plan(View(0, (4,), (1,)), View(5, (4,), (1,)))
    assert coverage(gap, ["t0", "t1"]) == {"d": False}


# -- PlanState: adopt, disable, judge ---------------------------------------------------


def test_adopting_a_plan_logs_its_counts_and_an_empty_plan_is_off_saying_why(
        caplog: pytest.LogCaptureFixture) -> None:
    plan, _ = recorded()
    state = PlanState("toy")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        state.adopt(plan, None)
    assert state.state == "verifying" and state.plan is plan
    assert [r.getMessage() for r in caplog.records] == [
        "toy: copy plan recorded and checked against the loader: 7 tensors planned, "
        "2 on the loader"]
    empty = PlanState("toy")
    empty.adopt(CopyPlan(), None)
    assert (empty.state, empty.reason) == (
        "off", "the loader copies no tensor of the update as a plain copy")


def test_disable_warns_once_naming_the_engine_and_the_reason(
        caplog: pytest.LogCaptureFixture) -> None:
    plan, _ = recorded()
    state = PlanState("toy")
    state.adopt(plan, None)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        state.disable("first reason")
        state.disable("second reason")
    assert (state.state, state.reason) == ("off", "second reason")
    assert [r.getMessage() for r in caplog.records] == [
        "toy: the copy plan is off for this model: first reason"]


def test_judge_names_five_blamed_tensors_and_logs_what_the_loader_repaired(
        caplog: pytest.LogCaptureFixture) -> None:
    plan, _ = recorded()
    blamed = [f"layers.{i}.w" for i in range(7)]
    state = PlanState("toy")
    state.adopt(plan, None)
    state.judge(blamed, blamed)
    assert (state.state, state.reason) == (
        "off", "the first update through the plan differed from a fresh load (repaired from "
        f"it) in tensors the plan wrote: {blamed[:5]}")
    ok = PlanState("toy")
    ok.adopt(plan, None)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        ok.judge(["experts.w13", "experts.w2"], ["layers.0.w"])
    assert ok.state == "on"
    assert [r.getMessage() for r in caplog.records] == [
        "toy: the first update through the plan equalled a fresh load where the plan wrote; "
        "2 tensors the loader wrote were repaired"]


# -- PlanState.check_on_shadow ----------------------------------------------------------

LANDED = {"qkv", "embed", "scaled", "one", "wt", "norm", "plain"}


Hook = Callable[[nn.Module], None]


def shadow_loader(ws: dict[str, torch.Tensor]) -> Callable[[Hook], nn.Module]:
    """The engine's fresh load: a real model loaded by its own loader, `hook(shadow)`
    before any post-load processing."""
    def load_shadow(hook: Hook) -> nn.Module:
        shadow = loaded(ws)
        hook(shadow)
        return shadow
    return load_shadow


def test_a_plan_that_agrees_with_the_shadow_is_adopted_without_and_with_verification() -> None:
    plan, ws = recorded()
    state = PlanState("toy")
    state.check_on_shadow(plan, Verifier("toy"), loaded(ws), shadow_loader(ws), ws, LANDED,
                          verify=False)
    assert (state.state, state.reason, state.plan) == ("verifying", None, plan)
    # with verification: one fresh load checks the plan AND repairs the stale live model
    stale = Fused()
    verifier = Verifier("toy")
    both = PlanState("toy")
    both.check_on_shadow(plan, verifier, stale, shadow_loader(ws), ws, LANDED, verify=True)
    assert (both.state, both.reason) == ("verifying", None)
    assert verifier.last is not None and verifier.last["ok"] is True
    assert verifier.verified == 1 and verifier.last["compared"] == 7
    assert sorted(verifier.last["repaired"]) == sorted(LANDED)
    for name, p in loaded(ws).named_parameters():
        assert torch.equal(p, dict(stale.named_parameters())[name]), name


def test_a_plan_the_shadow_disagrees_with_is_off_naming_the_tensor() -> None:
    plan, ws = recorded()
    route = plan.routes["scaled"]        # claim "scaled" is a plain copy: the loader doubles it
    route.reason = None
    route.steps = [Step("scaled", View(0, (4,), (1,)), View(0, (4,), (1,)))]
    plan.layouts["scaled"] = Layout((4,), (1,), torch.float32)
    for verify in (False, True):
        state = PlanState("toy")
        state.check_on_shadow(plan, Verifier("toy"), loaded(ws), shadow_loader(ws), ws,
                              LANDED, verify=verify)
        assert (state.state, state.reason) == (
            "off", "replaying ['scaled'] into scaled does not give what the loader wrote "
            "(bits differ)"), verify


def test_a_check_that_raises_turns_the_plan_off_naming_the_exception() -> None:
    plan, ws = recorded()
    bad = dict(ws, plain=torch.randn(2, 2))   # too small for the recorded source view
    state = PlanState("toy")
    state.check_on_shadow(plan, Verifier("toy"), loaded(ws), shadow_loader(ws), bad, LANDED,
                          verify=False)
    assert state.state == "off"
    assert (state.reason or "").startswith("the check failed: RuntimeError: ")


def test_no_shadow_turns_the_plan_off_saying_why() -> None:
    plan, ws = recorded()

    def no_room(hook: Hook) -> nn.Module:
        raise RuntimeError("no room for a second model")

    state = PlanState("toy")
    state.check_on_shadow(plan, Verifier("toy"), loaded(ws), no_room, ws, LANDED, verify=False)
    assert (state.state, state.reason) == (
        "off", "no shadow to check it on: RuntimeError: no room for a second model")
    # verifying: the verifier swallows it (the update stays unverified); the plan says why
    verified = PlanState("toy")
    verified.check_on_shadow(plan, Verifier("toy"), loaded(ws), no_room, ws, LANDED,
                             verify=True)
    assert (verified.state, verified.reason) == (
        "off", "no shadow could be built to check it on (not verified: RuntimeError: no room "
        "for a second model)")
    # a fresh load that never reached the hook: no verdict at all is not a pass
    silent = PlanState("toy")
    silent.check_on_shadow(plan, Verifier("toy"), loaded(ws), lambda hook: loaded(ws), ws,
                           LANDED, verify=False)
    assert (silent.state, silent.reason) == (
        "off", "no shadow could be built to check it on (None)")


# -- PlanState.verify_update ------------------------------------------------------------


def checking_state() -> PlanState:
    plan, _ = recorded()
    state = PlanState("toy")
    state.adopt(plan, None)
    assert state.state == "verifying"
    return state


def test_a_first_update_equal_to_a_fresh_load_turns_the_plan_on() -> None:
    _, ws = recorded()
    state, verifier = checking_state(), Verifier("toy")
    state.verify_update(verifier, loaded(ws), lambda: loaded(ws), LANDED, True, {"plain"})
    assert (state.state, state.reason) == ("on", None)
    assert verifier.last is not None and verifier.last["ok"] is True
    assert verifier.last["compared"] == 7


def test_a_first_update_that_differs_where_the_plan_wrote_turns_it_off() -> None:
    _, ws = recorded()
    live = loaded(ws)
    with torch.no_grad():
        live.plain.add_(1)
    state = checking_state()
    state.verify_update(Verifier("toy"), live, lambda: loaded(ws), LANDED, True, {"plain"})
    assert (state.state, state.reason) == (
        "off", "the first update through the plan differed from a fresh load (repaired from "
        "it) in tensors the plan wrote: ['plain']")
    # a later update (not checking) is verified and repaired, the state left alone
    later = checking_state()
    later.verify_update(Verifier("toy"), live, lambda: loaded(ws), LANDED, False, {"plain"})
    assert later.state == "verifying"


def test_an_unverifiable_first_update_turns_the_plan_off_with_the_cause() -> None:
    _, ws = recorded()

    def broken() -> nn.Module:
        raise RuntimeError("no room for a second model")

    state = checking_state()
    state.verify_update(Verifier("toy"), loaded(ws), broken, LANDED, True, {"plain"})
    assert (state.state, state.reason) == (
        "off", "the first update through the plan could not be verified (not verified: "
        "RuntimeError: no room for a second model)")
    later = checking_state()
    later.verify_update(Verifier("toy"), loaded(ws), broken, LANDED, False, {"plain"})
    assert later.state == "verifying"


def with_packed(ws: dict[str, torch.Tensor], *shape: int) -> Fused:
    m = loaded(ws)
    m.register_buffer("packed", torch.ones(*shape), persistent=False)
    return m


def test_an_unrepairable_update_raises_and_a_first_one_turns_the_plan_off() -> None:
    _, ws = recorded()
    state = checking_state()
    with pytest.raises(WeightsMismatch) as e:
        state.verify_update(Verifier("toy"), with_packed(ws, 2, 6), lambda: with_packed(ws, 3),
                            LANDED, True, {"plain"})
    assert (state.state, state.reason) == (
        "off", f"the first update through the plan differed from a fresh load: {e.value}")
    later = checking_state()
    with pytest.raises(WeightsMismatch):
        later.verify_update(Verifier("toy"), with_packed(ws, 2, 6), lambda: with_packed(ws, 3),
                            LANDED, False, {"plain"})
    assert (later.state, later.reason) == ("verifying", None)
