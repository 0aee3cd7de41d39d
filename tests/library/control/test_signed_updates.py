"""Authenticated updates (with a shared secret), refusal without change, replay
protection, keyed buckets; one update at a time; a restarted engine rejoins."""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import pytest
import torch
from torch import nn

from enginehooks import EngineHooksError, WeightSync
from enginehooks.core.auth import SECRET_ENV, AuthError, canonical, sign
from enginehooks.core.manifest import TensorSpec, plan
from enginehooks.engine.local import LocalEngine
from enginehooks.engine.side import EngineSide
from enginehooks.plugins import get_transport

SECRET = "s3cret-shared-by-trainer-and-engines"


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))


def same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.fixture
def guarded(monkeypatch: pytest.MonkeyPatch) -> LocalEngine:
    """A replica whose engine process has the shared secret."""
    monkeypatch.setenv(SECRET_ENV, SECRET)
    engine = LocalEngine(net(0), name="guarded")
    monkeypatch.delenv(SECRET_ENV)  # the trainers below bring their own (or none)
    return engine


def test_signed_updates_are_applied(guarded: LocalEngine) -> None:
    src = net(1)
    with WeightSync("gloo", timeout_s=20, secret=SECRET) as sync:
        sync.add_replica(guarded)
        assert sync.push(src, version=1).ok
    assert same(src, guarded.target.module) and guarded.side.version == 1


@pytest.mark.parametrize("secret", [None, "not-the-secret"], ids=["unsigned", "wrong secret"])
def test_unsigned_or_wrongly_signed_updates_are_refused_and_change_nothing(
        guarded: LocalEngine, secret: str | None) -> None:
    before = {k: v.clone() for k, v in guarded.target.module.state_dict().items()}
    with WeightSync("gloo", timeout_s=20, secret=secret) as sync:
        sync.add_replica(guarded)
        with pytest.raises(AuthError, match="join refused"):
            sync.push(net(2), version=9)
    assert guarded.side.version is None and guarded.side.state == "initial"
    assert all(torch.equal(before[k], v) for k, v in guarded.target.module.state_dict().items())


def test_a_trainer_with_a_secret_refuses_an_engine_without_one() -> None:
    """An engine that forgot the secret would accept anyone's push: the trainer says so
    before anything moves, instead of trusting a fleet that is only partly protected."""
    open_engine = LocalEngine(net(0), name="forgot-the-secret")
    before = {k: v.clone() for k, v in open_engine.target.module.state_dict().items()}
    assert open_engine.info(10)[0]["authenticated"] is False
    with WeightSync("gloo", timeout_s=20, secret=SECRET) as sync:
        sync.add_replica(open_engine)
        with pytest.raises(EngineHooksError, match=r"forgot-the-secret.*without the shared secret"):
            sync.push(net(2), version=1)
    assert open_engine.side.state == "initial"
    assert all(torch.equal(before[k], v)
               for k, v in open_engine.target.module.state_dict().items())


def test_replayed_messages_are_refused(guarded: LocalEngine) -> None:
    side = guarded.side
    m = plan([TensorSpec("0.weight", "float32", (32, 16))], weight_version=1,
             bucket_bytes=1 << 20).to_json()
    token = sign(SECRET.encode(), "check", canonical(m), [side.instance])
    side.call("check", m, token)  # fresh: accepted (problems listed, nothing changed)
    with pytest.raises(AuthError, match="replay"):
        side.call("check", m, token)
    with pytest.raises(AuthError, match="does not match"):  # a token for another message
        side.call("check", m.replace('"weight_version":1', '"weight_version":2'),
                  sign(SECRET.encode(), "check", canonical(m), [side.instance]))
    with pytest.raises(AuthError, match="signed for another replica"):  # names nobody
        side.call("check", m, sign(SECRET.encode(), "check", canonical(m)))
    with pytest.raises(AuthError, match="no valid authentication token"):
        side.call("join", json.dumps({"transport": "gloo"}), 1)


def test_buckets_not_signed_with_the_secret_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that reached the group without the secret cannot feed it buckets."""
    gloo = get_transport("gloo")
    # The group forms with the secret (its barrier keys are signed:
    # tests/library/transports/test_rendezvous_keys.py keeps a stranger out of it there); then the
    # sender packs without it, as a process already inside the group would.
    sender = gloo.sender(host="127.0.0.1", port=0, timeout_s=20, secret=SECRET.encode())
    monkeypatch.setenv(SECRET_ENV, SECRET)
    receiver = gloo.receiver(dict(sender.endpoint(), world_size=2), 1, torch.device("cpu"))
    t = threading.Thread(target=receiver.connect)
    t.start()
    sender.connect(2)
    t.join(20)
    sender.secret = None  # a stranger's buckets: no MAC
    tensors = {"w": torch.randn(8, 8)}
    m = plan([TensorSpec("w", "float32", (8, 8))], weight_version=1, bucket_bytes=4096,
             checksum="xxh3")
    box: dict[str, Any] = {}

    def receive() -> None:
        try:
            list(receiver.stream(m))
        except BaseException as e:
            box["error"] = e

    r = threading.Thread(target=receive)
    r.start()
    from enginehooks.transports.base import Abort

    sender.send(m, iter(tensors.items()), Abort())
    r.join(20)
    assert isinstance(box.get("error"), AuthError), box
    sender.close()
    receiver.close()


def test_two_trainers_pushing_at_once_never_interleave() -> None:
    replica = LocalEngine(net(0), name="shared")
    models = [net(10), net(11)]
    outcomes: list[Any] = [None, None]

    def trainer(i: int) -> None:
        try:
            with WeightSync("gloo", timeout_s=20, bucket_bytes=1024) as sync:
                sync.add_replica(replica)
                outcomes[i] = sync.push(models[i], version=f"trainer-{i}")
        except EngineHooksError as e:
            outcomes[i] = e

    threads = [threading.Thread(target=trainer, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    ok = [i for i in (0, 1) if not isinstance(outcomes[i], Exception)]
    assert ok, f"both pushes failed: {outcomes}"
    for i in (0, 1):
        if isinstance(outcomes[i], Exception):  # refused clearly, not a hang
            assert any(w in str(outcomes[i]) for w in ("one update at a time", "took it over",
                                                        "group")), outcomes[i]
    # The replica holds exactly one trainer's weights, the version it reports.
    holder = int(str(replica.side.version).rsplit("-", 1)[1])
    assert same(models[holder], replica.target.module)
    assert replica.side.state == "current"


def test_a_restarted_engine_rejoins_at_the_next_push() -> None:
    replica = LocalEngine(net(0), name="restarts")
    with WeightSync("gloo", timeout_s=20) as sync:
        sync.add_replica(replica)
        sync.push(net(1), version=1)
        # The engine process restarts: a fresh worker state, no group.
        replica.side = EngineSide(replica.side.binding)
        src = net(2)
        assert sync.push(src, version=2).ok
    assert replica.side.version == 2 and same(src, replica.target.module)


def test_replicas_added_or_removed_between_pushes_are_picked_up() -> None:
    a, b = LocalEngine(net(0), name="a"), LocalEngine(net(0), name="b")
    with WeightSync("gloo", timeout_s=20) as sync:
        sync.add_replica(a)
        sync.push(net(1), version=1)
        sync.add_replica(b)  # a new rollout replica joins the fleet
        src = net(2)
        report = sync.push(src, version=2)
        assert [r.name for r in report.replicas] == ["a", "b"] and report.ok
        assert a.side.version == b.side.version == 2
        assert same(src, a.target.module) and same(src, b.target.module)
        sync.remove_replica(a)  # and one leaves it
        src = net(3)
        assert [r.name for r in sync.push(src, version=3).replicas] == ["b"]
    assert b.side.version == 3 and same(src, b.target.module)
    assert a.side.version == 2 and same(net(2), a.target.module)
    assert a.side.group is None  # the group was rebuilt without it: a left


def _listeners(port: int) -> list[str]:
    """Local addresses of the sockets listening on `port` (from /proc/net/tcp{,6})."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, state = fields[1], fields[3]
                addr, hexport = local.rsplit(":", 1)
                if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                    found.append(addr)
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's socket tables")
@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_rendezvous_stores_listen_on_loopback_only(transport: str) -> None:
    """TCPStore's own server listens on every interface; ours must not (docs/security.md)."""
    sender = get_transport(transport).sender(host="127.0.0.1", port=0, timeout_s=5)
    try:
        port = sender.endpoint()["port"]
        # 127.0.0.1 in /proc/net/tcp's little-endian hex; nothing on 0.0.0.0 or [::].
        assert _listeners(port) == ["0100007F"]
    finally:
        sender.close()
