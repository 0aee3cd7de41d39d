"""Tests that kill the mutants `make mutants` found surviving in engine/verify.py and
engine/trace.py (docs/testing.md): what the verifier reports (`state()`, which the
engine's `info` carries to the trainer), the policy, and the closures it reads."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import pytest
import torch
from torch import nn

from enginehooks.core.errors import ConfigError
from enginehooks.engine.trace import ByteTracer, MetaScalars
from enginehooks.engine.verify import (
    Verdict,
    Verifier,
    WeightsMismatch,
    _with_aliases,
    compare,
    readable_tensors,
    touched_modules,
    verify_and_repair,
    verify_policy,
)
from tests.library.engine.test_trace_verify import Conv, trace


def test_a_verdict_reports_every_list_capped_at_50() -> None:
    names = [f"t{i}" for i in range(60)]
    v = Verdict(compared=7, mismatched=names, repaired=names[1:], unreadable=names[2:],
                probed=names[3:], unverified=names[4:], digest=2, digest_bytes=8,
                shadow_bytes=9)
    assert v.to_dict() == {"compared": 7, "mismatched": names[:50], "repaired": names[1:51],
                           "unreadable": names[2:52], "how": "digest+shadow", "digest": 2,
                           "digest_bytes": 8, "landed_bytes": 0, "arrived_bytes": 0,
                           "shadow_bytes": 9, "settled": False, "probed": names[3:53],
                           "unverified": names[4:54], "shadow_kind": "", "shadow_units": 0, "shadow_why": "",
                           "shadow_tensor_bytes": 0, "shadow_peak_bytes": None}


def test_the_policy_defaults_to_always_and_a_bad_value_names_the_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENGINEHOOKS_VERIFY", raising=False)
    assert verify_policy() == "always"
    monkeypatch.setenv("ENGINEHOOKS_VERIFY", " First ")
    assert verify_policy() == "first"
    monkeypatch.setenv("ENGINEHOOKS_VERIFY", "sometimes")
    with pytest.raises(ConfigError, match=r"ENGINEHOOKS_VERIFY='sometimes': one of \('always'"):
        verify_policy()


def test_a_bad_policy_is_logged_and_the_first_update_verified(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("ENGINEHOOKS_VERIFY", "sometimes")
    with caplog.at_level(logging.ERROR, logger="enginehooks.verify"):
        v = Verifier("toy")
    assert [r.getMessage() for r in caplog.records] == [
        "ENGINEHOOKS_VERIFY='sometimes': one of ('always', 'first', 'never'); "
        "verifying every update"]
    assert v.engine == "toy"
    assert v.state() == {"policy": "always", "verified": 0, "every_update": True,
                         "updates": {"verified": 0, "repaired": 0, "unverified": 0,
                                     "failed": 0}, "last": None}


def test_state_reports_each_verification_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINEHOOKS_VERIFY", "first")
    v = Verifier("toy")
    assert v.run(Conv(), Conv, {"weight"}) is not None
    assert v.run(Conv(), Conv, {"weight"}) is not None
    v.skipped()
    last = {"ok": True, "outcome": "verified", "compared": 3, "mismatched": [], "repaired": [],
            "unreadable": [], "how": "shadow", "digest": 0, "digest_bytes": 0,
            "landed_bytes": 0, "arrived_bytes": 0, "shadow_bytes": 3 * 4 * 3 * 4,
            "settled": False, "probed": [], "unverified": [],
            "shadow_kind": "whole", "shadow_units": 0, "shadow_tensor_bytes": 3 * 4 * 4,
            "shadow_why": "no streamed shadow offered (the engine gives none, or the copy "
                          "plan's first check reads the whole loader's result)",
            "shadow_peak_bytes": None}
    assert v.state() == {
        "policy": "first", "verified": 2, "every_update": False,
        "updates": {"verified": 2, "repaired": 0, "unverified": 1, "failed": 0},
        "last": {"ok": None, "how": "not verified",
                 "error": "not verified: ENGINEHOOKS_VERIFY=first"}}
    v.run(Conv(), Conv, {"weight"})
    seconds = v.state()["last"].pop("seconds")
    assert v.state()["last"] == last
    assert set(seconds) == {"reread_launch", "walk", "digest", "shadow", "compare"}


def test_an_unrepairable_update_is_reported_names_the_engine_and_verifies_every_update_after(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINEHOOKS_VERIFY", "first")
    v = Verifier("toy")
    v.run(Conv(), Conv, {"weight"})
    assert not v.wanted()

    def other_shape() -> nn.Module:
        m = Conv()
        m.register_buffer("alias", torch.ones(2, 6), persistent=False)
        return m

    with pytest.raises(WeightsMismatch, match="the toy engine's forward reads") as e:
        v.run(Conv(), other_shape, {"weight"})
    assert v.state()["last"] == {"ok": False, "error": str(e.value)}
    assert v.state()["every_update"] is True
    assert v.wanted()


def test_an_unverified_update_is_reported_and_logged_with_the_cause(
        caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> nn.Module:
        raise RuntimeError("no memory for a second model")

    v = Verifier("toy")
    with caplog.at_level(logging.WARNING, logger="enginehooks.verify"):
        assert v.run(Conv(), broken, {"weight"}) is None
    assert v.state()["last"] == {"ok": None,
                                 "error": "not verified: RuntimeError: no memory for a second model"}
    assert [r.getMessage() for r in caplog.records] == [
        "toy: could not verify this update (RuntimeError: no memory for a second model); the "
        "weights were applied by the engine's own reload path"]


def test_policies_always_and_never_and_a_trainers_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINEHOOKS_VERIFY", "always")
    v = Verifier("toy")
    assert v.state()["every_update"] is True
    v.run(Conv(), Conv, {"weight"})
    assert v.wanted()
    monkeypatch.setenv("ENGINEHOOKS_VERIFY", "never")
    never = Verifier("toy")
    assert not never.wanted() and never.wanted(requested=True)
    assert never.state()["every_update"] is False


def test_closures_with_an_empty_cell_and_callables_without_code_are_read() -> None:
    def make() -> object:
        a_empty = None
        z_tensor = torch.ones(2)

        def fn() -> object:
            return a_empty, z_tensor  # noqa: F821 (deleted below: an empty cell)

        del a_empty  # the cell stays, empty
        return fn

    m = nn.Module()
    m.fn = make()
    m.builtin = len  # callable, no __code__ nor __closure__
    found = readable_tensors(m)
    assert list(found) == ["fn<z_tensor>"]
    assert found["fn<z_tensor>"][0] == "closure"


def test_meta_scalars_answers_zeros_for_a_copy_off_the_meta_device() -> None:
    with MetaScalars():
        out = torch.ones(3, dtype=torch.float16, device="meta").to("cpu")
    assert out.device.type == "cpu" and out.dtype == torch.float16
    assert torch.equal(out, torch.zeros(3, dtype=torch.float16))


def nested() -> nn.Module:
    m = nn.Module()
    m.layers = nn.ModuleList([nn.Module()])
    m.layers[0].mlp = nn.Linear(2, 2)
    m.other = nn.Linear(2, 2)
    return m


def test_the_modules_touched_are_the_owner_and_every_ancestor() -> None:
    m = nested()
    assert touched_modules(m, {"layers.0.mlp.weight"}) == {"layers.0.mlp", "layers.0", "layers", ""}
    assert touched_modules(m, {"top"}) == {""}
    # the owner is the name's prefix, even where the name itself is a module's
    assert touched_modules(m, {"other"}) == {""}
    assert touched_modules(m, {"layers.0"}) == {"layers", ""}
    assert touched_modules(m, set()) == set()


class Aliased(nn.Module):
    """A tied head, a buffer shared by two submodules, a buffer viewing a parameter, and a
    buffer without storage (sparse) ahead of it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(2, 2, bias=False)
        self.head = nn.Linear(2, 2, bias=False)
        self.head.weight = self.embed.weight
        self.unrelated = nn.Parameter(torch.zeros(3))
        shared = torch.zeros(2)
        self.a, self.b = nn.Module(), nn.Module()
        self.a.register_buffer("buf", shared)
        self.b.register_buffer("buf", shared)
        self.register_buffer("sparse", torch.zeros(2, 2).to_sparse())
        self.register_buffer("view", self.unrelated.detach().view(3, 1))


def test_every_name_of_a_landed_storage_is_landed_too() -> None:
    m = Aliased()
    assert _with_aliases(m, {"embed.weight"}) == {"embed.weight", "head.weight"}
    assert _with_aliases(m, {"a.buf"}) == {"a.buf", "b.buf"}
    assert _with_aliases(m, {"unrelated"}) == {"unrelated", "view"}


class Block(nn.Module):
    """One of each case `compare` tells apart, each placed after a case it skips."""

    def __init__(self, fresh: bool) -> None:
        super().__init__()
        v = 1.0 if fresh else 0.0
        self.p_skip = nn.Parameter(torch.full((2,), v))          # not landed: not compared
        if not fresh:
            self.p_live_only = nn.Parameter(torch.zeros(2))      # the fresh model lacks it
        self.p_values = nn.Parameter(torch.full((2,), v))
        self.p_dtype = nn.Parameter(torch.zeros(2, dtype=torch.float64 if fresh else torch.float32))
        self.p_shape = nn.Parameter(torch.zeros(3 if fresh else 2))
        self.register_buffer("b_meta", torch.zeros(2, device="cpu" if fresh else "meta"))
        self.register_buffer("b_same", torch.ones(2))
        self.cache = torch.zeros(5 if fresh else 4)              # runtime state: skipped
        packed = torch.zeros(6 if fresh else 7)
        self.fn = lambda: packed                                 # captured state: skipped
        self.a_values = torch.full((2,), v)


def test_compare_finds_each_kind_of_difference_and_skips_what_is_not_weights() -> None:
    def model(fresh: bool) -> nn.Module:
        m = nn.Module()
        m.a_untouched = nn.Linear(2, 2)
        m.Xblk = Block(fresh)
        return m

    live, fresh = model(False), model(True)
    landed = {f"Xblk.{n}" for n in ("p_live_only", "p_values", "p_dtype", "p_shape")}
    verdict = Verdict()
    found = compare(live, fresh, landed, verdict)
    assert [(m.name, m.kind, m.why) for m in found] == [
        ("Xblk.p_values", "param", "values"), ("Xblk.p_dtype", "param", "dtype"),
        ("Xblk.p_shape", "param", "shape"), ("Xblk.a_values", "attr", "values")]
    blk, fblk = live.Xblk, fresh.Xblk
    for m, key in zip(found, ("p_values", "p_dtype", "p_shape", "a_values")):
        assert m.live is getattr(blk, key) and m.fresh is getattr(fblk, key)
    assert verdict.compared == 6  # p_values, p_dtype, p_shape, b_meta, b_same, a_values
    assert verdict.unreadable == ["Xblk.b_meta"]


class Many(nn.Module):
    def __init__(self, value: float, width: int = 2) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        for i in range(9):
            self.register_buffer(f"b{i}", torch.full((width,), value))


def test_a_repair_is_logged_naming_the_first_8_and_counting_all(
        caplog: pytest.LogCaptureFixture) -> None:
    live = Many(0.0)
    with caplog.at_level(logging.WARNING, logger="enginehooks.verify"):
        verdict = verify_and_repair(live, lambda: Many(1.0), {"w"}, engine="toy")
    assert verdict.repaired == [f"b{i}" for i in range(9)]
    assert torch.equal(live.b8, torch.ones(2))
    assert [r.getMessage() for r in caplog.records] == [
        "toy: after the update 9 tensors differed from a fresh load of the same weights ("
        + ", ".join(f"b{i} [values]" for i in range(8))
        + "); repaired in place from the fresh load: 9"]


def test_what_cannot_be_repaired_is_named_first_8_with_what_to_do() -> None:
    with pytest.raises(WeightsMismatch) as e:
        verify_and_repair(Many(0.0), lambda: Many(0.0, width=3), {"w"}, engine="toy")
    assert str(e.value) == (
        "after the update, 9 tensors the toy engine's forward reads differ from a fresh load "
        "of the same weights and could not be repaired: "
        + ", ".join(f"b{i} (shape)" for i in range(8))
        + "; the engine is torn and refuses generation until an update succeeds (report it "
        "upstream: the engine's reload path)")


def test_the_tracer_records_exactly_where_each_tensor_lands_and_in_what_dtype() -> None:
    tr = trace(["a", "b", "c", "d", "up", "gate", "dropped"], dtype=torch.bfloat16)
    assert tr.sizes == {"a": 16, "b": 4, "c": 1, "d": 8, "fused": 32}
    assert {n: (w.into, w.dtypes) for n, w in tr.written.items()} == {
        "a": ({"a": 16}, {"a": torch.float32}), "b": ({"b": 4}, {"b": torch.float32}),
        "c": ({"c": 1}, {"c": torch.float32}),
        "d": ({"d": 8}, {"d": torch.bfloat16}),  # assigned: the parameter holds the bf16 tensor
        "up": ({"fused": 16}, {"fused": torch.float32}),
        "gate": ({"fused": 16}, {"fused": torch.float32}), "dropped": ({}, {})}
    assert tr.current is None


class Staged(nn.Module):
    """A loader that stages through a temporary, writes one parameter in two halves, and
    reads a scalar out of one tensor before copying another."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.zeros(4))
        self.q = nn.Parameter(torch.zeros(2, 2))
        self.r = nn.Parameter(torch.zeros(3))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], seen: list) -> None:
        for name, w in weights:
            seen.append(name)
            if name == "p":
                tmp = torch.empty(4, device=w.device)
                tmp.copy_(w)
                self.p.data.copy_(tmp)
            elif name == "q":
                self.q.data[0].copy_(w[0])
                self.q.data[1].copy_(w[1])
            elif name == "x":
                _ = w.sum().item()
            elif name == "r":
                self.r.data.copy_(w)


def test_staged_halved_and_scalar_preceded_writes_are_attributed_exactly() -> None:
    with torch.device("meta"):
        model = Staged()
    tr = ByteTracer(model)
    shapes = {"p": (4,), "q": (2, 2), "x": (1,), "r": (3,)}
    feed = ((n, torch.empty(s, device="meta")) for n, s in shapes.items())
    current: list = []
    with torch.no_grad(), tr:
        model.load_weights(((n, t) for n, t in tr.feed(feed) if not current.append(tr.current)),
                           [])
    tr.settle(model)
    assert current == ["p", "q", "x", "r"] and tr.current is None
    assert {n: w.into for n, w in tr.written.items()} == {
        "p": {"p": 4}, "q": {"q": 4}, "x": {}, "r": {"r": 3}}


def test_zero_is_typed_like_the_dtype() -> None:
    from enginehooks.engine.trace import _zero

    assert _zero(torch.bool) is False
    for dtype in (torch.float32, torch.complex64):
        assert _zero(dtype) == 0 and isinstance(_zero(dtype), float)
    assert _zero(torch.int64) == 0 and isinstance(_zero(torch.int64), int)


class Sundry(nn.Module):
    """A loader that reads a fed tensor off the meta device, sums two fed tensors, writes
    through `out=`, and writes a temporary and a parameter in one op."""

    def __init__(self) -> None:
        super().__init__()
        self.host = nn.Parameter(torch.zeros(3))
        self.sum = nn.Parameter(torch.zeros(3))
        self.out = nn.Parameter(torch.zeros(3))
        self.hi = nn.Parameter(torch.zeros(3))
        self.tied = self.host
        self.register_buffer("shared", torch.zeros(1))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        got = dict(weights)
        self.host.data.copy_(got["h"].to("cpu", torch.float64))
        self.sum.data.copy_(got["s1"] + got["s2"])
        torch.add(got["o"], 0, out=self.out.data)
        lo = torch.empty(3, device=got["m"].device)
        torch.aminmax(got["m"], dim=0, out=(lo, self.hi.data))


def test_reads_off_meta_sums_out_arguments_and_multi_output_writes_are_traced() -> None:
    with torch.device("meta"):
        model = Sundry()
    model.other = nn.Module()
    model.other.register_buffer("shared", model.shared)
    tr = ByteTracer(model)
    assert tr.current is None
    assert tr.sizes == {"host": 3, "sum": 3, "out": 3, "hi": 3, "tied": 3, "shared": 1,
                        "other.shared": 1}
    shapes = {"h": (3,), "s1": (3,), "s2": (3,), "o": (3,), "m": (2, 3)}
    feed = ((n, torch.empty(s, device="meta")) for n, s in shapes.items())
    with torch.no_grad(), tr:
        model.load_weights(tr.feed(feed))
    assert {n: w.into for n, w in tr.written.items()} == {
        "h": {"host": 3}, "s1": {"sum": 3}, "s2": {"sum": 3}, "o": {"out": 3}, "m": {"hi": 3}}
    with MetaScalars():
        out = torch.ones(2, dtype=torch.float16, device="meta").to("cpu", torch.float64)
    assert out.dtype == torch.float64


def test_readable_tensors_names_every_kind_a_forward_can_read() -> None:
    """Parameters and buffers under every name they are registered by (a tensor tied
    to two names in one module is two entries), tensor attributes, private ones
    included, and what a callable attribute captured: closure cells and tensor
    default arguments. A child's tensors are its own."""
    m = nn.Module()
    p = nn.Parameter(torch.ones(2))
    m.register_parameter("weight", p)
    m.register_parameter("weight_alias", p)
    b = torch.zeros(3)
    m.register_buffer("scale", b)
    m.register_buffer("scale_alias", b)
    m.register_buffer("unset", None)
    m.cache = torch.full((2,), 5.0)
    m._private = torch.full((1,), 7.0)
    default = torch.full((1,), 9.0)
    m.fn = lambda x, w=default, k=3: x * w * k
    m.child = nn.Linear(2, 2)
    found = readable_tensors(m)
    assert {k: kind for k, (kind, _) in found.items()} == {
        "weight": "param", "weight_alias": "param", "scale": "buffer",
        "scale_alias": "buffer", "cache": "attr", "_private": "attr",
        "fn<default0>": "closure"}
    assert found["weight_alias"][1] is p and found["scale_alias"][1] is b
    assert found["_private"][1] is m._private and found["fn<default0>"][1] is default
