"""The rendezvous store's own keys (issue 36): a forming group's arrival barrier and its
call-off are signed with the shared secret, and a key that does not verify is ignored,
logged, never obeyed: a process that reached the store can neither end a forming group
with its own words (which the trainer then blamed on a healthy replica) nor fake a
rank's arrival. Without a secret the keys are bare and obeyed, as before.

Real stores and real gloo groups; the attacker is a third `TCPStore` client.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
import torch

from enginehooks.control._futures import spawn
from enginehooks.core.auth import SECRET_ENV
from enginehooks.core.errors import TransportError
from enginehooks.transports._rendezvous import (
    arrive,
    barrier_key,
    call_off,
    client_store,
    master_store,
)
from enginehooks.transports.broadcast import BroadcastReceiver, BroadcastSender

SECRET = b"rendezvous-key-secret"
PREFIX = "enginehooks/g0/"


@pytest.fixture
def stores() -> Any:
    master = master_store("127.0.0.1", 0, 10.0)
    attacker = client_store("127.0.0.1", master.port, 10.0)
    engine = client_store("127.0.0.1", master.port, 10.0)
    yield master, engine, attacker


def test_a_forged_call_off_is_ignored_and_the_group_forms(
        stores: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Protective line: `channel.open("abort", ...)` in `_rendezvous.arrive` (without it
    both ranks end with the attacker's text)."""
    master, engine, attacker = stores
    attacker.set(barrier_key(PREFIX, "abort"), b"replica refused: set ENGINEHOOKS_SECRET")
    caplog.set_level(logging.WARNING, "enginehooks.transport")
    ranks = [spawn(arrive, s, PREFIX, 2, 5.0, r, SECRET) for r, s in ((0, master), (1, engine))]
    for f in ranks:
        f.result(timeout=10)  # the group formed: no error from the forged key
    assert any("abort is not signed" in r.getMessage() for r in caplog.records)


def test_the_senders_signed_call_off_ends_every_wait_at_once(stores: Any) -> None:
    master, engine, _ = stores
    waiting = spawn(arrive, engine, PREFIX, 3, 20.0, 1, SECRET)
    time.sleep(0.2)
    t0 = time.monotonic()
    call_off(master, PREFIX, "replica r1 refused its join: AuthError", SECRET)
    with pytest.raises(TransportError, match=r"called off by the sender: replica r1 refused"):
        waiting.result(timeout=10)
    assert time.monotonic() - t0 < 2


def test_a_call_off_signed_with_another_secret_is_ignored(stores: Any) -> None:
    master, engine, attacker = stores
    call_off(attacker, PREFIX, "forged", b"another-secret")
    ranks = [spawn(arrive, s, PREFIX, 2, 5.0, r, SECRET) for r, s in ((0, master), (1, engine))]
    for f in ranks:
        f.result(timeout=10)


def test_a_forged_arrival_does_not_count(stores: Any) -> None:
    """Protective line: `channel.open("arrived", ...)` in `arrive` (without it rank 0
    goes on into the process group's constructor as if rank 1 were there)."""
    master, _, attacker = stores
    attacker.set(barrier_key(PREFIX, "arrived/1"), b"1")
    t0 = time.monotonic()
    with pytest.raises(TransportError, match=r"did not form within 1.0s: 1 of 2 ranks arrived; "
                                             r"1 message\(s\) that did not verify.*arrived/1"):
        arrive(master, PREFIX, 2, 1.0, 0, SECRET)
    assert time.monotonic() - t0 >= 0.9


def test_an_arrival_moved_to_another_rank_does_not_count(stores: Any) -> None:
    master, engine, attacker = stores
    arrive_done = threading.Event()
    # rank 2's genuine arrival copied to rank 1's key
    spawn(lambda: (arrive(engine, PREFIX, 3, 1.0, 2, SECRET), arrive_done.set()))
    deadline = time.monotonic() + 5
    while not master.check([barrier_key(PREFIX, "arrived/2")]):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    attacker.set(barrier_key(PREFIX, "arrived/1"), master.get(barrier_key(PREFIX, "arrived/2")))
    with pytest.raises(TransportError, match=r"2 of 3 ranks arrived"):
        arrive(master, PREFIX, 3, 1.0, 0, SECRET)


def test_without_a_secret_the_call_off_is_bare_and_obeyed(stores: Any) -> None:
    """No secret, no protection (docs/security.md): exactly the behaviour before."""
    _, engine, attacker = stores
    attacker.set(barrier_key(PREFIX, "abort"), b"anyone's words")
    with pytest.raises(TransportError, match="called off by the sender: anyone's words"):
        arrive(engine, PREFIX, 2, 5.0, 1, None)


def test_a_real_gloo_group_forms_despite_a_forged_call_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The broadcast transport's sender and receiver sign their barrier keys with the
    secret (the receiver's from its environment, as in an engine worker), and push a
    bucket through the group after the attacker's call-off."""
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())
    sender = BroadcastSender("gloo", host="127.0.0.1", port=0, timeout_s=10.0, secret=SECRET)
    ep = dict(sender.endpoint(), world_size=2)
    attacker = client_store("127.0.0.1", ep["port"], 10.0)
    attacker.set(barrier_key(f"enginehooks/{ep['group']}/", "abort"), b"called off: set ENGINEHOOKS_SECRET")
    receiver = BroadcastReceiver(ep, 1, torch.device("cpu"))
    try:
        joined = spawn(receiver.connect)
        sender.connect(2)
        joined.result(timeout=20)
        assert sender.pg is not None and receiver.pg is not None
    finally:
        receiver.close()
        sender.close()
