"""Authenticated control messages of the colocated transports (`shm` here; `cuda_ipc`
shares the code and runs in tests/gpu): forged acks, aborts and buffer descriptors
written by a third client of the trainer's store are refused, and the refusal ends the
update on both sides with an error naming the key, within the timeout.

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
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from enginehooks.control._futures import spawn
from enginehooks.core.auth import SECRET_ENV, AuthError
from enginehooks.core.buckets import message_bytes, read_trailer
from enginehooks.core.errors import ChecksumError, SenderAborted, TransportError
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
from tests.unit.test_transports_colocated import BUCKET, DictTarget, same_bits, specs, weights

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


def test_a_forged_ok_ack_is_refused_before_the_slot_is_refilled(make: Any) -> None:
    """The critical case of issue 19: an `ok` for a bucket the receiver is still reading.
    Accepted, the sender would pack bucket 2 into the slot under the receiver's views.
    Protective line: `self.channel.open("ack", ...)` in `ColocatedSender._wait_acks`
    (without it the sender refills slot 0 and this test sees no refusal)."""
    g = make()
    hold = threading.Event()  # the engine is still busy with bucket 0's first tensor
    ws = weights(1)
    m = g.manifest(ws, 1)
    assert len(m.buckets) > 3
    fut = spawn(g.receivers[0].deliver, m, DictTarget(hold=hold))
    g.attacker.set(g.key("u1/ack/0/1"), b"ok")
    try:
        t0 = time.monotonic()
        with pytest.raises(ControlMessageRefused, match=r"u1/ack/0/1 is not signed"):
            g.sender.send(m, iter(ws.items()), Abort())
        assert time.monotonic() - t0 < 4  # refused at once, not at the 5 s timeout
        # Slot 0 still holds bucket 0, untouched: the forged ack freed nothing.
        assert read_trailer(g.sender.bufs[0][: message_bytes(m.buckets[0].nbytes)])[2] == 0
        assert g.sender.broken
    finally:
        hold.set()
    # The receiver hears a (signed) abort that names the refused ack.
    with pytest.raises(SenderAborted, match=r"ControlMessageRefused.*u1/ack/0/1"):
        fut.result(timeout=10)


def test_an_ack_signed_with_another_secret_is_refused(make: Any) -> None:
    g = make()
    hold = threading.Event()
    ws = weights(2)
    m = g.manifest(ws, 1)
    fut = spawn(g.receivers[0].deliver, m, DictTarget(hold=hold))
    wrong = ControlChannel(b"not-the-secret", g.sender.group_id, g.sender.prefix, "attacker")
    g.attacker.set(g.key("u1/ack/0/1"), wrong.seal("ack", 1, 0, 1, TO_TRAINER, b"ok"))
    try:
        with pytest.raises(ControlMessageRefused, match=r"u1/ack/0/1 does not verify"):
            g.sender.send(m, iter(ws.items()), Abort())
    finally:
        hold.set()
    with pytest.raises(SenderAborted):
        fut.result(timeout=10)


def test_a_forged_abort_is_refused_and_the_sender_hears_why(make: Any) -> None:
    """A forged `{"abort": ...}` no longer passes for the trainer's: the receiver refuses
    it as a forged control message, naming the key (not `SenderAborted` with the
    attacker's text), and tells the sender through its signed error acks. The update
    ends on both sides (an engine side then reports `torn` with this error: never a
    silent stop). Protective line: `self.channel.open("ready", ...)` in
    `ColocatedReceiver._slot` (without it the receiver raises `SenderAborted`)."""
    g = make()
    ws = weights(3)
    m = g.manifest(ws, 1)
    g.attacker.set(g.key("u1/ready/0"), json.dumps({"abort": "forged by a stranger"}).encode())
    fut = spawn(g.receivers[0].deliver, m, DictTarget())
    with pytest.raises(ControlMessageRefused, match=r"rank 1: control message .*u1/ready/0"):
        fut.result(timeout=10)
    assert g.receivers[0].broken
    with pytest.raises(TransportError,
                       match=r"receiver rank 1 failed on bucket 0: error: ControlMessageRefused"):
        g.sender.send(m, iter(ws.items()), Abort())


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
def test_a_forged_buffer_descriptor_is_refused_before_anything_is_mapped(
        make: Any, tmp_path: Path, signature: str) -> None:
    """A descriptor pointing the engine at memory the attacker prepared is refused.
    Protective line: `self.channel.open("buffers", ...)` in `ColocatedReceiver._slot`
    (without it the receiver maps the attacker's files, or fails to parse, and raises
    some other error)."""
    g = make(sender_cls=RacingAttackerSender)
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
    with pytest.raises(TransportError, match="receiver rank 1 failed on bucket 0"):
        g.sender.send(m, iter(ws.items()), Abort())
    with pytest.raises(ControlMessageRefused, match=r"control message .*buffers/1"):
        fut.result(timeout=10)
    assert mapped == []  # nothing the attacker described was ever mapped


def test_a_trainer_without_the_secret_is_refused_with_the_fix(make: Any) -> None:
    g = make(secret=None)  # the engines have a secret, the trainer forgot it
    ws = weights(5)
    m = g.manifest(ws, 1)
    fut = spawn(g.receivers[0].deliver, m, DictTarget())
    with pytest.raises(TransportError, match="receiver rank 1 failed on bucket 0"):
        g.sender.send(m, iter(ws.items()), Abort())
    with pytest.raises(ControlMessageRefused, match="set the same secret on the trainer"):
        fut.result(timeout=10)


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
    for, and waits (bounded) until the engine has answered it. The forged write goes
    through the attacker's own connection; the plugin only orders it first."""

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
        attacker.wait([f"{prefix}/ack/0/1"], timedelta(seconds=10))  # the engine answered
        return (yield)


def test_a_forged_abort_leaves_the_engine_torn_with_the_key_named_never_silent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What a forged abort does to an engine (issue 19 asked to define it): the update
    ends, the engine reports `torn` (its policy then refuses generation until the next
    push) with the refused key in its error, and the trainer's push fails naming the
    replica and the key. The attacker's text is never shown as the trainer's reason."""
    from torch import nn

    from enginehooks import EngineHooksError, WeightSync
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
            t0 = time.monotonic()
            with pytest.raises(EngineHooksError,
                               match=r"r0.*u1/ready/0 is not signed with the shared secret"):
                sync.push(net(1), version=1)
            assert time.monotonic() - t0 < 10
    finally:
        unregister_plugin(attacker)
    assert attacker.key is not None and attacker.key.endswith("u1/ready/0")
    assert engine.side.state == "torn" and engine.side.version is None
    assert "ControlMessageRefused: " in (engine.side.last_error or "")
    assert "u1/ready/0 is not signed" in (engine.side.last_error or "")
    assert "forged: stop serving" not in (engine.side.last_error or "")
