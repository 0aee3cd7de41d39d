"""Plan once, push many (`core/layout.py`, issue 37 item 1), with module replicas.

The first push plans, asks, checks and transfers (the full path); a later push of the
same layout is one signed `receive` per replica (`rpcs == 1`) naming the layout, and
lands the same bytes. Each change falls back to the full path: another dtype, a new
tensor (which the replica still refuses, in `check`, before any byte moves), a replica
that restarted (a new instance with no layout: `LayoutUnknown`, answered before its
token is read), a replica that lost the layout while still in the group, another
replica set, another trainer that took a replica over. A reference is still signed: a
forged one is refused and changes nothing.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from enginehooks import ManifestError, WeightSync
from enginehooks.core.auth import SECRET_ENV, AuthError
from enginehooks.core.errors import LayoutUnknown
from enginehooks.core.layout import parse_reference, reference, with_version
from enginehooks.core.manifest import TensorSpec, plan
from enginehooks.engine.local import LocalEngine
from enginehooks.engine.side import EngineSide

SECRET = "plan-once-secret"


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))


def same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sorted(sa) == sorted(sb) and all(torch.equal(sa[k].float(), sb[k]) for k in sa)


@pytest.fixture
def replicas(monkeypatch: pytest.MonkeyPatch) -> list[LocalEngine]:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    out = [LocalEngine(net(0), name=f"r{i}") for i in range(2)]
    monkeypatch.delenv(SECRET_ENV)
    return out


def train(m: nn.Module, by: float = 0.5) -> None:
    with torch.no_grad():
        for p in m.parameters():
            p.add_(by)


def restart(eng: LocalEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine process restarted: its group is gone, a new worker (a new instance
    id, no layout) serves the same model."""
    eng.side._leave()
    monkeypatch.setenv(SECRET_ENV, SECRET)
    eng.side = EngineSide(eng.side.binding)
    monkeypatch.delenv(SECRET_ENV)


def test_a_steady_push_is_one_signed_call_per_replica_and_lands_the_same_bytes(
        replicas: list[LocalEngine]) -> None:
    src = net(1)
    with WeightSync("gloo", timeout_s=20, secret=SECRET, bucket_bytes=1024) as sync:
        for r in replicas:
            sync.add_replica(r)
        first = sync.push(src, 1)
        assert first.layout == "planned" and first.rpcs >= 4  # info, join, check, receive
        for version in (2, 3):
            train(src)
            report = sync.push(src, version)
            assert report.ok and report.layout == "prepared"
            assert [res.rpcs for res in report.replicas] == [1, 1]  # the steady state
            assert report.bytes == first.bytes and report.buckets == first.buckets > 1
            for r in replicas:
                assert same(src, r.target.module) and r.side.version == version
                assert r.side.state == "current"


def test_another_dtype_or_a_new_tensor_takes_the_full_path(replicas: list[LocalEngine]) -> None:
    src = net(1)
    with WeightSync("gloo", timeout_s=20, secret=SECRET) as sync:
        for r in replicas:
            sync.add_replica(r)
        sync.push(src, 1)
        # another dtype in the trainer: a new plan (the wire dtype is the replica's)
        double = net(1).double()
        report = sync.push(double, 2)
        assert report.layout == "planned" and report.rpcs > 1
        assert all(same(double, r.target.module) for r in replicas)
        assert sync.push(double, 3).layout == "prepared"
        # a new tensor: the full path, whose check refuses it before any byte moves
        extra = net(1).double()
        extra.register_parameter("bonus", nn.Parameter(torch.ones(3, dtype=torch.float64)))
        with pytest.raises(ManifestError) as e:
            sync.push(extra, 4)
        assert e.value.report.layout == "planned"
        assert all(r.side.version == 3 and r.side.state == "current" for r in replicas)
        # after a failure the next push plans in full again, then keeps the layout
        assert sync.push(double, 5).layout == "planned"
        assert sync.push(double, 6).layout == "prepared"


@pytest.mark.parametrize("change", ["restarted", "lost its layout"])
def test_a_replica_without_the_layout_falls_back_to_the_full_path(
        replicas: list[LocalEngine], monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    src = net(1)
    # a short timeout: the healthy replica's receive may wait out its data plane's
    # timeout (a collective group with a member gone carries no abort notice)
    with WeightSync("gloo", timeout_s=4, secret=SECRET, bucket_bytes=1024) as sync:
        for r in replicas:
            sync.add_replica(r)
        sync.push(src, 1)
        assert sync.push(src, 2).layout == "prepared"
        if change == "restarted":
            restart(replicas[1], monkeypatch)
        else:
            replicas[1].side._layouts.clear()
        train(src)
        report = sync.push(src, 3)
        assert report.ok and report.layout.startswith("fallback: replica 'r1'")
        assert "holds no layout" in report.layout
        for r in replicas:
            assert same(src, r.target.module) and r.side.version == 3
            assert r.side.state == "current"
        train(src)
        again = sync.push(src, 4)  # the full path established the layout anew
        assert again.layout == "prepared" and again.rpcs == 1


def test_a_replica_another_trainer_took_over_falls_back_and_rejoins(
        replicas: list[LocalEngine]) -> None:
    src, other = net(1), net(7)
    with WeightSync("gloo", timeout_s=4, secret=SECRET) as sync:
        sync.add_replica(replicas[0])
        sync.push(src, 1)
        assert sync.push(src, 2).layout == "prepared"
        with WeightSync("gloo", timeout_s=20, secret=SECRET) as thief:
            thief.add_replica(replicas[0])
            thief.push(other, 100)
            assert same(other, replicas[0].target.module)
            train(src)
            report = sync.push(src, 3)  # the worker is in the thief's group now
            assert report.ok and report.layout.startswith("fallback: replica 'r0'")
            assert "group" in report.layout
            assert same(src, replicas[0].target.module) and replicas[0].side.version == 3


def test_another_replica_set_takes_the_full_path(replicas: list[LocalEngine]) -> None:
    src = net(1)
    with WeightSync("gloo", timeout_s=20, secret=SECRET) as sync:
        sync.add_replica(replicas[0])
        sync.push(src, 1)
        sync.add_replica(replicas[1])
        assert sync.push(src, 2).layout == "planned"
        assert same(src, replicas[1].target.module)
        sync.remove_replica(replicas[1])
        assert sync.push(src, 3).layout == "planned"
        assert sync.push(src, 4).layout == "prepared"


def test_a_reference_is_signed_and_an_unknown_layout_changes_nothing(
        replicas: list[LocalEngine]) -> None:
    src = net(1)
    with WeightSync("gloo", timeout_s=20, secret=SECRET) as sync:
        sync.add_replica(replicas[0])
        sync.push(src, 1)
        side = replicas[0].side
        (layout,) = list(side._layouts)
        group = side.group
        assert group is not None
        with pytest.raises(AuthError):  # a known layout, a forged (missing) token
            side.receive(reference(layout, 99), group, None)
        with pytest.raises(LayoutUnknown):  # answered before the token is read
            side.receive(reference("nope", 99), group, None)
        assert side.version == 1 and side.state == "current"


def test_references_parse_strictly() -> None:
    assert parse_reference(reference("abc", 7)) == ("abc", 7)
    m = plan([TensorSpec("w", "float32", (4,))], weight_version=1, bucket_bytes=64)
    assert parse_reference(m.to_json()) is None  # a whole manifest
    assert parse_reference("not json") is None
    with pytest.raises(ManifestError, match="weight_version"):
        parse_reference('{"layout": "abc", "weight_version": true}')
    with pytest.raises(ManifestError, match="short string"):
        parse_reference('{"layout": 5, "weight_version": 1}')
    assert with_version(m, 2).weight_version == 2 and with_version(m, 2).tensors == m.tensors
