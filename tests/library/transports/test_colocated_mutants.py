"""The colocated transports' protective checks (`transports/colocated.py`), pinned where
mutation testing found them loose (issue 26 item 2; docs/testing.md, third run): the
control messages' MAC and where it binds them, the receiver's checks of a ready message
and of a buffer descriptor before anything is mapped, and the sender's reading of acks.

Real stores and real shm buffers: a `ShmSender` (its store, its descriptor), a
`ShmReceiver` connected to it, and messages written with the group's own
`ControlChannel` (or a third store client, as an attacker would). The receiver's and the
sender's checking methods (`_ready_message`, `_slot`, `_wait_acks`) are called directly,
which is what lets each refusal be pinned to its exact text.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from enginehooks.control._futures import spawn
from enginehooks.core.auth import SECRET_ENV, AuthError
from enginehooks.core.errors import SenderAborted, TransferStalled, TransportError
from enginehooks.transports._rendezvous import client_store
from enginehooks.transports.base import Abort
from enginehooks.transports.colocated import (
    EVERY_RECEIVER,
    MAC_SEP,
    TO_ENGINE,
    TO_TRAINER,
    TRAINER_SELF,
    ControlChannel,
    ControlMessageRefused,
    control_mac,
)
from enginehooks.transports.shm import ShmReceiver, ShmSender

SECRET = b"colocated-mutants-secret"
pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")


# -- the channel ------------------------------------------------------------------------------
def test_keys_of_each_kind() -> None:
    ch = ControlChannel(SECRET, "g", "enginehooks/g/", "t")
    assert ch.key("buffers", 7, 3, EVERY_RECEIVER) == "enginehooks/g/buffers/3"
    assert ch.key("ready", 7, 3, EVERY_RECEIVER) == "enginehooks/g/u7/ready/3"
    assert ch.key("ack", 7, 3, 2) == "enginehooks/g/u7/ack/3/2"


def test_control_mac_is_hmac_sha256_of_the_bound_fields_and_body() -> None:
    head = b"enginehooks-colocated/1\ng\nack\n7\n3\n2\nengine->trainer\n"
    want = hmac.new(SECRET, head + b"ok", hashlib.sha256).hexdigest()
    assert control_mac(SECRET, group="g", kind="ack", seq=7, index=3, audience=2,
                       direction=TO_TRAINER, body=b"ok") == want
    ch = ControlChannel(SECRET, "g", "enginehooks/g/", "t")
    assert ch.seal("ack", 7, 3, 2, TO_TRAINER, b"ok") == b"ok" + MAC_SEP + want.encode()


def test_an_unsigned_or_cut_mac_is_refused_naming_the_key() -> None:
    ch = ControlChannel(SECRET, "g", "enginehooks/g/", "rank 1")
    sealed = ch.seal("ack", 7, 3, 2, TO_TRAINER, b"ok")
    assert ch.open("ack", 7, 3, 2, (TO_TRAINER,), sealed) == b"ok"
    unsigned = ("rank 1: control message enginehooks/g/u7/ack/3/2 is not signed with the "
                "shared secret (forged by a process that reached the rendezvous store, or "
                "the other side runs without ENGINEHOOKS_SECRET: set the same secret on the "
                "trainer and every engine)")
    for raw in (b"ok", sealed[:-1], sealed + b"0", b"ok" + MAC_SEP):
        with pytest.raises(ControlMessageRefused) as e:
            ch.open("ack", 7, 3, 2, (TO_TRAINER,), raw)
        assert str(e.value) == unsigned
    wrong = sealed[:-1] + (b"0" if sealed[-1:] != b"0" else b"1")
    with pytest.raises(ControlMessageRefused) as e:
        ch.open("ack", 7, 3, 2, (TO_TRAINER,), wrong)
    assert str(e.value) == (
        "rank 1: control message enginehooks/g/u7/ack/3/2 does not verify with the shared "
        "secret (forged, moved from another key, or signed with another secret: the trainer "
        "and every engine need the same ENGINEHOOKS_SECRET)")
    assert isinstance(e.value, AuthError) and isinstance(e.value, TransportError)


def test_a_message_verifies_under_any_of_the_directions_its_reader_accepts() -> None:
    ch = ControlChannel(SECRET, "g", "enginehooks/g/", "t")
    own = ch.seal("ack", 1, 0, 1, TRAINER_SELF, b"error: aborted")
    assert ch.open("ack", 1, 0, 1, (TO_TRAINER, TRAINER_SELF), own) == b"error: aborted"
    theirs = ch.seal("ack", 1, 0, 1, TO_TRAINER, b"ok")
    assert ch.open("ack", 1, 0, 1, (TO_TRAINER, TRAINER_SELF), theirs) == b"ok"
    with pytest.raises(ControlMessageRefused):
        ch.open("ack", 1, 0, 1, (TO_ENGINE,), own)


def test_a_body_that_holds_the_separator_keeps_it() -> None:
    ch = ControlChannel(SECRET, "g", "enginehooks/g/", "t")
    body = b"error: a\nmac=b"
    assert ch.open("ack", 1, 0, 1, (TO_TRAINER,), ch.seal("ack", 1, 0, 1, TO_TRAINER, body)) == body
    bare = ControlChannel(None, "g", "enginehooks/g/", "t")
    # without a secret, a body that merely contains the separator is read whole
    assert bare.open("ack", 1, 0, 1, (TO_TRAINER,), body) == body


# -- a receiver's reading of the store --------------------------------------------------------
class Rig:
    """A real shm sender (store, buffers, descriptor) and one receiver joined to it; the
    sender's channel writes the messages the tests need."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, secret: bytes | None = SECRET,
                 timeout_s: float = 2.0) -> None:
        self.sender = ShmSender(host="127.0.0.1", port=0, timeout_s=timeout_s, secret=secret)
        ep = dict(self.sender.endpoint(), world_size=2)
        with monkeypatch.context() as mp:
            if secret:
                mp.setenv(SECRET_ENV, secret.decode())
            else:
                mp.delenv(SECRET_ENV, raising=False)
            self.receiver = ShmReceiver(ep, 1, torch.device("cpu"))
        self.receiver.connect()
        self.sender.connect(2)
        self.ch = self.sender.channel
        self.attacker = client_store("127.0.0.1", ep["port"], timeout_s)

    def key(self, rest: str) -> str:
        return f"enginehooks/{self.sender.group_id}/{rest}"

    def ready(self, seq: int, index: int, body: Any, signed: bool = True) -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        if signed:
            raw = self.ch.seal("ready", seq, index, EVERY_RECEIVER, TO_ENGINE, raw)
        self.attacker.set(self.key(f"u{seq}/ready/{index}"), raw)

    def descriptor(self, gen: int, body: Any, signed: bool = True) -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        if signed:
            raw = self.ch.seal("buffers", 0, gen, EVERY_RECEIVER, TO_ENGINE, raw)
        self.attacker.set(self.key(f"buffers/{gen}"), raw)

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch) -> Iterator[Rig]:
    r = Rig(monkeypatch)
    yield r
    r.close()


def test_a_ready_message_of_this_update_is_returned(rig: Rig) -> None:
    rig.ready(1, 0, {"gen": 1, "slot": 0, "mid": 42})
    assert rig.receiver._ready_message(1, 0, 42) == {"gen": 1, "slot": 0, "mid": 42}


def test_a_ready_message_of_another_update_is_refused(rig: Rig) -> None:
    rig.ready(1, 0, {"gen": 1, "slot": 0, "mid": 41})
    with pytest.raises(TransportError) as e:
        rig.receiver._ready_message(1, 0, 42)
    assert str(e.value) == ("bucket 0 belongs to another update (manifest id 41, expected 42); "
                            "the group's update counters drifted")
    rig.ready(1, 1, {"gen": 1, "slot": 1})
    with pytest.raises(TransportError, match="manifest id None, expected 42"):
        rig.receiver._ready_message(1, 1, 42)


def test_a_signed_abort_is_the_senders_reason(rig: Rig) -> None:
    rig.ready(2, 3, {"abort": "stream broke", "mid": 42})
    with pytest.raises(SenderAborted) as e:
        rig.receiver._ready_message(2, 3, 42)
    assert str(e.value) == "the sender aborted the update: stream broke"


@pytest.mark.parametrize("body", [b"[1, 2]", b"not json", b'"text"', b"7",
                                  b"[" + b"1, " * 60 + b"1]"])  # shown cut at 80 bytes
def test_an_unreadable_ready_message_is_refused(rig: Rig, body: bytes) -> None:
    rig.ready(1, 0, body)
    with pytest.raises(TransportError) as e:
        rig.receiver._ready_message(1, 0, 42)
    assert str(e.value) == f"bucket 0: unreadable ready message {body[:80]!r}"


IGNORED = r"; 1 message\(s\) that did not verify were ignored at \['enginehooks/\w+/"


def test_an_unsigned_ready_message_is_never_read_and_the_wait_goes_on(rig: Rig) -> None:
    rig.ready(1, 0, {"abort": "forged"}, signed=False)
    with pytest.raises(TransferStalled,
                       match=r"^shm rank 1: bucket 0 did not arrive within 2.0s" + IGNORED
                       + r"u1/ready/0'\] \(written by a process that reached"):
        rig.receiver._ready_message(1, 0, 42)


def test_the_genuine_ready_message_that_replaces_a_forged_one_is_taken(rig: Rig) -> None:
    rig.ready(1, 0, {"abort": "forged"}, signed=False)
    got = spawn(rig.receiver._ready_message, 1, 0, 42)
    time.sleep(0.3)
    assert not got.done()
    rig.ready(1, 0, {"gen": 1, "slot": 0, "mid": 42})
    assert got.result(timeout=5) == {"gen": 1, "slot": 0, "mid": 42}


def test_a_missing_ready_message_ends_the_wait_at_the_timeout(rig: Rig) -> None:
    with pytest.raises(TransportError) as e:
        rig.receiver._ready_message(1, 5, 42)
    assert str(e.value).startswith("shm rank 1: bucket 5 did not arrive within 2.0s (")


@pytest.mark.parametrize("body", [{"slot": 0, "mid": 42}, {"gen": 1, "mid": 42},
                                  {"gen": "x", "slot": 0, "mid": 42},
                                  {"gen": 1, "slot": None, "mid": 42}])
def test_a_ready_message_without_a_generation_and_slot_is_refused(rig: Rig, body: Any) -> None:
    rig.ready(1, 0, body)
    with pytest.raises(TransportError) as e:
        rig.receiver._slot(1, 0, 42)
    assert str(e.value) == f"bucket 0: malformed ready message {body!r:.200}"


def test_a_ready_message_naming_the_other_slot_is_refused(rig: Rig) -> None:
    rig.ready(1, 3, {"gen": 1, "slot": 0, "mid": 42})
    with pytest.raises(TransportError) as e:
        rig.receiver._slot(1, 3, 42)
    assert str(e.value) == ("bucket 3: ready message names slot 0, the sender packs bucket 3 "
                            "into slot 1")


def test_a_new_generation_maps_the_signed_descriptor_once(rig: Rig) -> None:
    rig.sender._ensure_buffers(4096)  # generation 1: real files, a signed descriptor
    rig.sender.bufs[1][:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    rig.ready(1, 0, {"gen": 1, "slot": 0, "mid": 42})
    rig.ready(1, 1, {"gen": 1, "slot": 1, "mid": 42})
    assert rig.receiver._slot(1, 0, 42) == 0
    assert rig.receiver.gen == 1 and len(rig.receiver.bufs) == 2
    mapped = rig.receiver.bufs[1]
    assert mapped[:4].tolist() == [1, 2, 3, 4]  # the sender's own bytes
    # the same generation: nothing is mapped again, even if its descriptor is gone
    rig.attacker.delete_key(rig.key("buffers/1"))
    assert rig.receiver._slot(1, 1, 42) == 1
    assert rig.receiver.bufs[1] is mapped


def test_an_unsigned_descriptor_is_refused_before_anything_is_mapped(rig: Rig) -> None:
    rig.descriptor(1, {"dir": "/dev/shm", "files": ["a", "b"], "nbytes": 64}, signed=False)
    rig.ready(1, 0, {"gen": 1, "slot": 0, "mid": 42})
    with pytest.raises(TransferStalled, match=r"buffer generation 1 did not arrive within 2.0s"
                                              + IGNORED + r"buffers/1'\]"):
        rig.receiver._slot(1, 0, 42)
    assert rig.receiver.bufs == [] and rig.receiver.gen == 0


def test_a_descriptor_signed_for_another_generation_is_refused(rig: Rig) -> None:
    body = json.dumps({"dir": "/dev/shm", "files": ["a", "b"], "nbytes": 64}).encode()
    rig.attacker.set(rig.key("buffers/2"),
                     rig.ch.seal("buffers", 0, 1, EVERY_RECEIVER, TO_ENGINE, body))
    rig.ready(1, 0, {"gen": 2, "slot": 0, "mid": 42})
    with pytest.raises(TransferStalled, match=IGNORED + r"buffers/2'\]"):
        rig.receiver._slot(1, 0, 42)
    assert rig.receiver.bufs == []


@pytest.mark.parametrize("body", [b"[1]", b"{not json", b'"x"'])
def test_a_malformed_descriptor_is_refused(rig: Rig, body: bytes) -> None:
    rig.descriptor(1, body)
    rig.ready(1, 0, {"gen": 1, "slot": 0, "mid": 42})
    with pytest.raises(TransportError) as e:
        rig.receiver._slot(1, 0, 42)
    assert str(e.value) == f"malformed buffer descriptor {body!r:.200}"
    assert rig.receiver.bufs == [] and rig.receiver.gen == 0


def test_a_descriptor_is_read_with_the_generation_the_ready_message_names(rig: Rig) -> None:
    # generation 2 announced: its descriptor is read from buffers/2, not buffers/1
    rig.descriptor(1, {"dir": "/nowhere", "files": ["x"], "nbytes": 8})
    rig.ready(1, 0, {"gen": 2, "slot": 0, "mid": 42})
    with pytest.raises(TransportError) as e:
        rig.receiver._slot(1, 0, 42)
    assert str(e.value).startswith("shm rank 1: buffer generation 2 did not arrive within")


# -- a sender's reading of acks ---------------------------------------------------------------
def test_an_error_ack_fails_the_sender_with_the_receivers_reason(rig: Rig) -> None:
    rig.attacker.set(rig.key("u1/ack/0/1"),
                     rig.ch.seal("ack", 1, 0, 1, TO_TRAINER, b"error: ChecksumError: bad"))
    with pytest.raises(TransportError) as e:
        rig.sender._wait_acks(1, 0, Abort())
    assert str(e.value) == "shm: receiver rank 1 failed on bucket 0: error: ChecksumError: bad"


def test_an_ok_ack_frees_the_slot_and_marks_the_generation_mapped(rig: Rig) -> None:
    rig.sender._ensure_buffers(4096)
    files = list(Path("/dev/shm").glob(f"enginehooks-{rig.sender.group_id}-*"))
    assert files
    rig.attacker.set(rig.key("u1/ack/0/1"), rig.ch.seal("ack", 1, 0, 1, TO_TRAINER, b"ok"))
    rig.sender._wait_acks(1, 0, Abort())
    assert rig.sender.gen in rig.sender._mapped_gens
    assert not any(f.exists() for f in files)  # every receiver mapped: unlinked


def test_an_ack_moved_from_another_bucket_or_update_frees_nothing(rig: Rig) -> None:
    for seq, index in ((1, 1), (2, 0)):
        rig.attacker.set(rig.key("u1/ack/0/1"),
                         rig.ch.seal("ack", seq, index, 1, TO_TRAINER, b"ok"))
        with pytest.raises(TransportError, match=r"^shm: receivers \[1\] did not acknowledge "
                                                 r"bucket 0 within 2.0s" + IGNORED + r"u1/ack/0/1"):
            rig.sender._wait_acks(1, 0, Abort())


def test_the_genuine_ack_that_replaces_a_forged_one_frees_the_slot(rig: Rig) -> None:
    rig.attacker.set(rig.key("u1/ack/0/1"), b"ok")
    waiting = spawn(rig.sender._wait_acks, 1, 0, Abort())
    time.sleep(0.3)
    assert not waiting.done()
    rig.attacker.set(rig.key("u1/ack/0/1"), rig.ch.seal("ack", 1, 0, 1, TO_TRAINER, b"ok"))
    waiting.result(timeout=5)


def test_a_missing_ack_names_the_late_receiver(rig: Rig) -> None:
    with pytest.raises(TransportError) as e:
        rig.sender._wait_acks(1, 4, Abort())
    assert str(e.value).startswith("shm: receivers [1] did not acknowledge bucket 4 within 2.0s (")
    # names the store's own error (a timeout), not a placeholder
    assert str(e.value).endswith(("(DistStoreError)", "(RuntimeError)", "(TimeoutError)"))


def test_the_coordinators_abort_wins_over_an_ack(rig: Rig) -> None:
    rig.attacker.set(rig.key("u1/ack/0/1"), rig.ch.seal("ack", 1, 0, 1, TO_TRAINER, b"ok"))
    abort = Abort()
    abort.fail(TransportError("replica r1 failed"))
    with pytest.raises(TransportError) as e:
        rig.sender._wait_acks(1, 0, abort)
    assert str(e.value).startswith("update aborted: ")
    assert "replica r1 failed" in str(e.value)


def test_an_error_ack_that_is_not_utf8_still_reads(rig: Rig) -> None:
    rig.attacker.set(rig.key("u1/ack/0/1"),
                     rig.ch.seal("ack", 1, 0, 1, TO_TRAINER, b"error: \xff"))
    with pytest.raises(TransportError) as e:
        rig.sender._wait_acks(1, 0, Abort())
    assert str(e.value) == "shm: receiver rank 1 failed on bucket 0: error: \ufffd"
