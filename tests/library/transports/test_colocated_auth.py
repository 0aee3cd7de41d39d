"""Authenticated control messages of the colocated transports (`shm` here; `cuda_ipc`
shares the code and runs in tests/gpu): forged acks, aborts, joins and buffer
descriptors written by a third client of the trainer's store are never obeyed; they are
logged and ignored, the genuine message completes the update, and when none comes the
update ends at its timeout naming the keys that held what did not verify (issue 36).

The attacker is a real third `TCPStore` client (`client_store`), as an outsider who
reached the store's port would be. No mocks. Where the attacker must win a race with the
real sender (a descriptor overwritten between the sender's write and the receiver's
read), a sender subclass only provides the timing: the forged write still goes through
the attacker's own store connection.

Each test was checked to fail with the protective line removed (see the comment on it).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from enginehooks.control._futures import spawn
from enginehooks.core.auth import SECRET_ENV, AuthError
from enginehooks.core.buckets import message_bytes, read_trailer
from enginehooks.core.errors import ChecksumError, SenderAborted, TransferStalled, TransportError
from enginehooks.core.manifest import Manifest, plan
from enginehooks.markers import hookimpl
from enginehooks.plugins import register_plugin, unregister_plugin
from enginehooks.transports._rendezvous import client_store
from enginehooks.transports.base import Abort
from enginehooks.transports.colocated import (
    EVERY_RECEIVER,
    TO_ENGINE,
    TO_TRAINER,
    TRAINER_SELF,
    ControlChannel,
    ControlMessageRefused,
)
from enginehooks.transports.shm import ShmReceiver, ShmSender, ShmTransport
from tests.library.transports.test_colocated import BUCKET, DictTarget, same_bits, specs, weights

SECRET = "colocated-control-secret"
SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this host")


class SecretGroup:
    """A sender with `secret` and `n` thread-hosted receivers whose engine process has
    `engine_secret` (read from ENGINEHOOKS_SECRET at construction, as in a worker)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, secret: str | None = SECRET,
                 engine_secret: str | None = SECRET, n: int = 1, timeout_s: float = 5.0,
                 sender_cls: type[ShmSender] = ShmSender) -> None:
        self.sender = sender_cls(host="127.0.0.1", port=0, timeout_s=timeout_s,
                                 secret=secret.encode() if secret else None)
        self.endpoint = json.loads(json.dumps(dict(self.sender.endpoint(), world_size=n + 1)))
        with monkeypatch.context() as mp:
            if engine_secret:
                mp.setenv(SECRET_ENV, engine_secret)
            else:
                mp.delenv(SECRET_ENV, raising=False)
            t = ShmTransport()
            self.receivers: list[ShmReceiver] = [
                t.receiver(self.endpoint, r, torch.device("cpu"))  # type: ignore[misc]
                for r in range(1, n + 1)]
        for r in self.receivers:
            r.connect()
        self.sender.connect(n + 1)
        # The attacker: a client that reached the store's port, without the secret.
        self.attacker = client_store("127.0.0.1", self.endpoint["port"], timeout_s)

    def key(self, rest: str) -> str:
        return f"enginehooks/{self.sender.group_id}/{rest}"

    def manifest(self, ws: dict[str, torch.Tensor], version: int) -> Manifest:
        m = plan(specs(ws), weight_version=version, bucket_bytes=BUCKET, checksum="xxh3")
        return Manifest.from_json(m.to_json())

    def close(self) -> None:
        for r in self.receivers:
            r.close()
        self.sender.close()


@pytest.fixture
def make(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    made: list[SecretGroup] = []

    def build(**kw: Any) -> SecretGroup:
        g = SecretGroup(monkeypatch, **kw)
        made.append(g)
        return g

    yield build
    for g in made:
        g.close()


def test_signed_pushes_round_trip_and_every_message_carries_a_mac(make: Any) -> None:
    g = make(n=2)
    seen: dict[str, bytes] = {}

    class Spy(DictTarget):
        def apply(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
            # While bucket 0 is being read, its ready key and descriptor are in the store.
            seen["ready"] = g.attacker.get(g.key("u1/ready/0"))
            seen["buffers"] = g.attacker.get(g.key("buffers/1"))
            super().apply(tensors)

    for version in (1, 2):
        ws = weights(version)
        m = g.manifest(ws, version)
        targets = [Spy(), DictTarget()] if version == 1 else [DictTarget(), DictTarget()]
        futs = [spawn(r.deliver, m, t) for r, t in zip(g.receivers, targets, strict=True)]
        g.sender.send(m, iter(ws.items()), Abort())
        for f in futs:
            f.result(timeout=10)
        for t in targets:
            assert all(same_bits(t.got[n], w) for n, w in ws.items())
    assert b"\nmac=" in seen["ready"] and b"\nmac=" in seen["buffers"]


def _sending(g: Any, m: Manifest, ws: dict[str, torch.Tensor]) -> Any:
    """The sender's `send` on a thread (the tests watch it while it waits)."""
    return spawn(g.sender.send, m, iter(ws.items()), Abort())


def test_a_forged_ok_ack_is_ignored_and_the_slot_is_not_refilled(
        make: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The critical case of issue 19: an `ok` for a bucket the receiver is still reading.
    Accepted, the sender would pack bucket 2 into the slot under the receiver's views.
    Now it is noise: the sender logs it, keeps waiting for the receiver's own ack
    (which overwrites it), and the push completes bit-exact. Protective line:
    `self.channel.open("ack", ...)` in `ColocatedSender._wait_acks` (without it the
    sender refills slot 0 while the receiver holds it: the trailer check below fails)."""
    g = make(timeout_s=10.0)
    hold = threading.Event()  # the engine is still busy with bucket 0's first tensor
    ws = weights(1)
    m = g.manifest(ws, 1)
    assert len(m.buckets) > 3
    target = DictTarget(hold=hold)
    fut = spawn(g.receivers[0].deliver, m, target)
    g.attacker.set(g.key("u1/ack/0/1"), b"ok")
    try:
        send = _sending(g, m, ws)
        time.sleep(1.5)  # long enough for the sender to have read (and ignored) it
        assert not send.done()
        # Slot 0 still holds bucket 0, untouched: the forged ack freed nothing.
        assert read_trailer(g.sender.bufs[0][: message_bytes(m.buckets[0].nbytes)])[2] == 0
    finally:
        hold.set()
    assert send.result(timeout=10).buckets == len(m.buckets)
    fut.result(timeout=10)
    assert all(same_bits(target.got[n], w) for n, w in ws.items())
    assert any("u1/ack/0/1 is not signed" in r.getMessage() for r in caplog.records)


def test_an_ack_signed_with_another_secret_is_ignored(make: Any,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    g = make(timeout_s=10.0)
    hold = threading.Event()
    ws = weights(2)
    m = g.manifest(ws, 1)
    target = DictTarget(hold=hold)
    fut = spawn(g.receivers[0].deliver, m, target)
    wrong = ControlChannel(b"not-the-secret", g.sender.group_id, g.sender.prefix, "attacker")
    g.attacker.set(g.key("u1/ack/0/1"), wrong.seal("ack", 1, 0, 1, TO_TRAINER, b"ok"))
    try:
        send = _sending(g, m, ws)
        time.sleep(1.0)
        assert not send.done()
    finally:
        hold.set()
    send.result(timeout=10)
    fut.result(timeout=10)
    assert all(same_bits(target.got[n], w) for n, w in ws.items())
    assert any("u1/ack/0/1 does not verify" in r.getMessage() for r in caplog.records)


def test_a_forged_abort_is_ignored_and_the_update_completes(
        make: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A forged `{"abort": ...}` no longer passes for the trainer's, and no longer ends
    the update either: the receiver logs it (naming the key) and waits for the genuine
    ready message, which the sender's write puts in its place. Protective line:
    `self.channel.open(kind, ...)` in `ColocatedReceiver._genuine` (without it the
    receiver raises `SenderAborted` with the attacker's text)."""
    g = make(timeout_s=10.0)
    ws = weights(3)
    m = g.manifest(ws, 1)
    g.attacker.set(g.key("u1/ready/0"), json.dumps({"abort": "forged by a stranger"}).encode())
    target = DictTarget()
    fut = spawn(g.receivers[0].deliver, m, target)
    deadline = time.monotonic() + 5
    while not any("u1/ready/0" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, "the receiver never read the forged abort"
        time.sleep(0.05)
    assert not fut.done()  # still waiting for the genuine message
    g.sender.send(m, iter(ws.items()), Abort())
    fut.result(timeout=10)
    assert all(same_bits(target.got[n], w) for n, w in ws.items())
    assert not g.receivers[0].broken


def test_forged_messages_alone_end_the_update_only_at_its_timeout(make: Any) -> None:
    """If nothing genuine comes (the trainer stalled, or an attacker overwrote the key
    after the genuine write), the wait ends at its timeout, as a stall, naming the key
    that held messages that did not verify; never with the attacker's words as the
    sender's abort."""
    g = make(timeout_s=2.0)
    ws = weights(3)
    m = g.manifest(ws, 1)
    g.attacker.set(g.key("u1/ready/0"), json.dumps({"abort": "set ENGINEHOOKS_SECRET"}).encode())
    t0 = time.monotonic()
    with pytest.raises(TransferStalled, match=r"bucket 0 did not arrive within 2.0s; 1 "
                                              r"message\(s\) that did not verify.*u1/ready/0"):
        g.receivers[0].deliver(m, DictTarget())
    assert 1.9 < time.monotonic() - t0 < 8


class RacingAttackerSender(ShmSender):
    """Gives the attacker's store client the race it needs: right after the sender
    wrote a buffer descriptor, `forge(gen)` overwrites it (through the attacker's own
    connection) before any ready key sends a receiver to read it. Test-only timing."""

    forge: Any = None

    def _ensure_buffers(self, nbytes: int) -> None:
        gen = self.gen
        super()._ensure_buffers(nbytes)
        if self.gen != gen and self.forge is not None:
            self.forge(self.gen)


@pytest.mark.parametrize("signature", ["unsigned", "wrong secret"])
def test_a_forged_buffer_descriptor_is_never_mapped(
        make: Any, tmp_path: Path, signature: str) -> None:
    """A descriptor pointing the engine at memory the attacker prepared is ignored;
    overwritten after the genuine one, it leaves the receiver waiting until its timeout
    (a stall naming the key), never mapping the attacker's files. Protective line:
    `self.channel.open(kind, ...)` in `ColocatedReceiver._genuine` (without it the
    receiver maps the attacker's files)."""
    g = make(sender_cls=RacingAttackerSender, timeout_s=2.0)
    nbytes = 4096 + 64
    for slot in (0, 1):  # the attacker's own "buffers", full of its bytes
        (tmp_path / f"evil-{slot}").write_bytes(b"\x42" * nbytes)
    desc = json.dumps({"dir": str(tmp_path), "files": ["evil-0", "evil-1"], "nbytes": nbytes},
                      sort_keys=True).encode()
    wrong = ControlChannel(b"guess" if signature == "wrong secret" else None,
                           g.sender.group_id, g.sender.prefix, "attacker")
    mapped: list[Any] = []
    receiver = g.receivers[0]
    real_map = receiver._map
    receiver._map = lambda d: mapped.append(d) or real_map(d)  # records what gets mapped

    def forge(gen: int) -> None:
        g.attacker.set(g.key(f"buffers/{gen}"),
                       wrong.seal("buffers", 0, gen, EVERY_RECEIVER, TO_ENGINE, desc))

    g.sender.forge = forge
    ws = weights(4)
    m = g.manifest(ws, 1)
    fut = spawn(receiver.deliver, m, DictTarget())
    with pytest.raises(TransportError, match="bucket 0"):  # the receiver's error, or its stall
        g.sender.send(m, iter(ws.items()), Abort())
    with pytest.raises(TransferStalled, match=r"did not verify.*buffers/1"):
        fut.result(timeout=10)
    assert mapped == []  # nothing the attacker described was ever mapped


def test_a_trainer_without_the_secret_is_never_obeyed_and_the_error_says_the_fix(
        make: Any) -> None:
    g = make(secret=None, timeout_s=2.0)  # the engines have a secret, the trainer forgot it
    ws = weights(5)
    m = g.manifest(ws, 1)
    fut = spawn(g.receivers[0].deliver, m, DictTarget())
    with pytest.raises(TransportError, match="bucket 0"):  # the receiver's error, or its stall
        g.sender.send(m, iter(ws.items()), Abort())
    with pytest.raises(TransferStalled, match="without the same ENGINEHOOKS_SECRET"):
        fut.result(timeout=10)


def test_a_forged_join_does_not_count_as_the_receiver(monkeypatch: pytest.MonkeyPatch) -> None:
    """`join/<rank>` is signed by the receiver that writes it: a forged one does not let
    the sender start before the receiver is there. Protective line:
    `self.channel.open("join", ...)` in `ColocatedSender.connect`."""
    sender = ShmSender(host="127.0.0.1", port=0, timeout_s=2.0, connect_timeout_s=2.0,
                       secret=SECRET.encode())
    try:
        attacker = client_store("127.0.0.1", sender.store.port, 5.0)
        attacker.set(f"enginehooks/{sender.group_id}/join/1", b"1")
        t0 = time.monotonic()
        with pytest.raises(TransportError, match=r"receivers \[1\] did not join within 2.0s; "
                                                 r"1 message\(s\) that did not verify"):
            sender.connect(2)
        assert time.monotonic() - t0 >= 1.9
        # the genuine receiver, signing its join, is let in
        monkeypatch.setenv(SECRET_ENV, SECRET)
        endpoint = dict(sender.endpoint(), world_size=2)
        receiver = ShmTransport().receiver(endpoint, 1, torch.device("cpu"))
        receiver.connect()
        sender.connect(2)
        receiver.close()
    finally:
        sender.close()


def test_failures_still_cross_over_signed(make: Any) -> None:
    """The real sender's aborts and the real receivers' error acks are signed, so the
    ordinary failure paths (a broken stream, a corrupted bucket) keep their messages."""
    g = make(n=2)
    ws = weights(6)
    m = g.manifest(ws, 1)
    futs = [spawn(r.deliver, m, DictTarget()) for r in g.receivers]

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        yield from list(ws.items())[:2]
        raise RuntimeError("trainer OOM while gathering")

    with pytest.raises(RuntimeError, match="trainer OOM"):
        g.sender.send(m, stream(), Abort())
    for f in futs:
        with pytest.raises(SenderAborted, match="trainer OOM"):
            f.result(timeout=10)

    class Corrupting(ShmSender):
        def _sealed(self, index: int, buf: torch.Tensor) -> None:
            if index == 1:
                buf[5] ^= 0xFF

    g2 = make(sender_cls=Corrupting)
    fut = spawn(g2.receivers[0].deliver, m, DictTarget())
    with pytest.raises(TransportError, match=r"rank 1 failed on bucket 1.*ChecksumError"):
        g2.sender.send(m, iter(ws.items()), Abort())
    with pytest.raises(ChecksumError):
        fut.result(timeout=10)


def test_the_coordinators_abort_still_ends_a_blocked_send(make: Any) -> None:
    """The watcher's abort notes are signed `trainer->trainer`, which the sender accepts
    in an ack key (and only there)."""
    g = make(timeout_s=20.0)
    hold = threading.Event()
    ws = weights(7)
    m = g.manifest(ws, 1)
    fut = spawn(g.receivers[0].deliver, m, DictTarget(hold=hold))
    abort = Abort()
    threading.Timer(0.5, abort.fail, (RuntimeError("replica r0 died"),)).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(TransportError, match="replica r0 died"):
            g.sender.send(m, iter(ws.items()), abort)
        assert time.monotonic() - t0 < 5
    finally:
        hold.set()
    with pytest.raises(SenderAborted):
        fut.result(timeout=10)


# -- the MAC's bindings, one field at a time -------------------------------------------

FIELDS = dict(kind="ack", seq=3, index=4, audience=1, direction=TO_TRAINER)


@pytest.mark.parametrize("change", [
    {"kind": "ready"}, {"seq": 4}, {"index": 5}, {"audience": 2}, {"direction": TO_ENGINE},
    {"direction": TRAINER_SELF}, {"group": "othergroup00"}, {"body": b"error: x"},
], ids=lambda c: next(iter(c)))
def test_a_message_moved_anywhere_else_does_not_verify(change: dict[str, Any]) -> None:
    """Each field the MAC binds (group, kind, update, bucket, audience, direction, body)
    is checked: a genuine message replayed under any other value is refused."""
    mine = ControlChannel(SECRET.encode(), "group0000000", "enginehooks/group0000000/", "t")
    sealed = mine.seal(FIELDS["kind"], FIELDS["seq"], FIELDS["index"], FIELDS["audience"],
                       FIELDS["direction"], b"ok")
    assert mine.open(FIELDS["kind"], FIELDS["seq"], FIELDS["index"], FIELDS["audience"],
                     (FIELDS["direction"],), sealed) == b"ok"
    fields = dict(FIELDS, **{k: v for k, v in change.items() if k not in ("group", "body")})
    reader = mine
    if "group" in change:
        reader = ControlChannel(SECRET.encode(), change["group"], "enginehooks/x/", "t")
    if "body" in change:
        sealed = change["body"] + sealed[sealed.rindex(b"\nmac="):]
    with pytest.raises(ControlMessageRefused, match="does not verify"):
        reader.open(fields["kind"], fields["seq"], fields["index"], fields["audience"],
                    (fields["direction"],), sealed)
    assert issubclass(ControlMessageRefused, AuthError)
    assert issubclass(ControlMessageRefused, TransportError)


def test_without_a_secret_messages_are_bare_and_a_signed_one_is_read() -> None:
    """No secret: bodies travel as before; a MAC from a side that has one is ignored."""
    bare = ControlChannel(None, "g", "enginehooks/g/", "t")
    assert bare.seal("ack", 1, 0, 1, TO_TRAINER, b"ok") == b"ok"
    signed = ControlChannel(b"k", "g", "enginehooks/g/", "t").seal("ack", 1, 0, 1, TO_TRAINER, b"ok")
    assert bare.open("ack", 1, 0, 1, (TO_TRAINER,), signed) == b"ok"
    assert bare.open("ack", 1, 0, 1, (TO_TRAINER,), b"error: boom") == b"error: boom"


# -- what an engine makes of a forged abort, end to end ----------------------------------


class ForgedAbortFirst:
    """A trainer-side plugin that plays the attacker's timing: before the real send, a
    third store client writes an unsigned abort into the ready key the engine waits
    for, and gives the engine a moment to read it. The forged write goes through the
    attacker's own connection; the plugin only orders it first."""

    def __init__(self) -> None:
        self.key: str | None = None

    @hookimpl(wrapper=True)
    def send_weights(self, transport: str, sender: Any, manifest: Manifest, stream: Any,
                     abort: Abort) -> Any:
        ep = sender.endpoint()
        attacker = client_store("127.0.0.1", ep["port"], 10.0)
        prefix = f"enginehooks/{ep['group']}/u{sender.seq + 1}"
        self.key = f"{prefix}/ready/0"
        attacker.set(self.key, json.dumps({"abort": "forged: stop serving"}).encode())
        time.sleep(1.0)  # the engine reads the forged abort first (bounded)
        return (yield)


def test_a_forged_abort_neither_tears_the_engine_nor_ends_the_push(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """What a forged abort does to an engine (issue 19 asked to define it; issue 36 made
    it noise): nothing. The engine logs it naming the key, keeps waiting, takes the
    genuine update and ends `current` on the new version with the trainer's weights;
    the push succeeds. Before issue 36 the engine ended `torn`, so anyone who reached
    the store could keep it torn."""
    from torch import nn

    from enginehooks import WeightSync
    from enginehooks.engine.local import LocalEngine

    def net(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 8))

    # The engine process has the secret for its whole life (its receivers read it when
    # they join); the in-process trainer passes its own explicitly.
    monkeypatch.setenv(SECRET_ENV, SECRET)
    engine = LocalEngine(net(0), name="r0")
    attacker = ForgedAbortFirst()
    register_plugin(attacker, name="forged-abort-first")
    try:
        with WeightSync("shm", timeout_s=10, bucket_bytes=4096, secret=SECRET) as sync:
            sync.add_replica(engine)
            report = sync.push(net(1), version=1)
            assert report.ok
    finally:
        unregister_plugin(attacker)
    assert attacker.key is not None and attacker.key.endswith("u1/ready/0")
    assert engine.side.state == "current" and engine.side.version == 1
    want = net(1).state_dict()
    got = engine.target.module.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert any(attacker.key in r.getMessage() and "is not signed" in r.getMessage()
               for r in caplog.records)
