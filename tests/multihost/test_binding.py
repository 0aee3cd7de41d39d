"""Which address each side of a gloo group binds (`transports/_rendezvous.py`), and the
harness itself (`enginehooks_testkit/netns.py`): always torn down, faults that act."""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

import pytest
import torch

from enginehooks.core.errors import TransportError
from enginehooks.transports._rendezvous import (
    GLOO_IFNAME_ENV,
    client_store,
    gloo_devices,
    local_address,
    master_store,
    new_group,
)
from enginehooks_testkit.netns import PREFIX, Network, sweep_stale


def test_local_address_is_this_hosts_end_of_the_route() -> None:
    assert local_address("127.0.0.1") == "127.0.0.1"
    assert local_address("localhost") in ("127.0.0.1", "::1")


def two_ranks_broadcast() -> torch.Tensor:
    """A gloo group of two (rank 1 on a thread) over loopback; rank 1's received tensor."""
    store = master_store("127.0.0.1", 0, 20.0)
    got: dict[str, Any] = {}

    def rank1() -> None:
        try:
            pg = new_group("gloo", client_store("127.0.0.1", store.port, 20.0), "t/", 1, 2, 20.0,
                           host="127.0.0.1")
            t = torch.zeros(4)
            pg.broadcast([t]).wait()
            got["t"] = t
        except BaseException as e:
            got["error"] = e

    th = threading.Thread(target=rank1)
    th.start()
    pg = new_group("gloo", store, "t/", 0, 2, 20.0, host="127.0.0.1")
    pg.broadcast([torch.arange(4.0)]).wait()
    th.join(30)
    assert "error" not in got, got
    return got["t"]  # type: ignore[no-any-return]


def test_gloo_binds_the_named_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GLOO_IFNAME_ENV, "lo")
    assert torch.equal(two_ranks_broadcast(), torch.arange(4.0))


def test_a_missing_interface_is_an_error_that_names_the_setting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GLOO_IFNAME_ENV, "no-such-if0")
    with pytest.raises(TransportError, match=f"{GLOO_IFNAME_ENV}='no-such-if0'"):
        gloo_devices("127.0.0.1")


def test_a_wildcard_store_host_says_to_pass_the_trainers_address(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(GLOO_IFNAME_ENV, raising=False)
    with pytest.raises(TransportError, match="pass the trainer's address"):
        gloo_devices("0.0.0.0")


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.split()}


def test_the_harness_tears_everything_down_even_when_the_body_fails(netns_ok: None) -> None:
    with pytest.raises(RuntimeError, match="body failed"), Network(["x", "y"]) as net:
        made = {h.ns for h in net.hosts.values()} | {net.switch}
        assert made <= namespaces()
        sleeper = net.hosts["x"].popen([sys.executable, "-c", "import time; time.sleep(600)"])
        raise RuntimeError("body failed")
    assert sleeper.poll() is not None
    assert made.isdisjoint(namespaces())


def test_the_next_network_deletes_namespaces_a_killed_test_left(netns_ok: None) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"{PREFIX}{dead.pid}-1-switch"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    assert stale in sweep_stale()
    assert stale not in namespaces()


PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 7000), timeout=3).close()
    print("reached")
except OSError as e:
    print(type(e).__name__)
"""
LISTEN = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 7000)); s.listen(); print("up", flush=True)
while True:
    s.accept()[0].close()
"""


def test_faults_cut_the_link_and_heal_restores_it(netns_ok: None) -> None:
    with Network(["a", "b"]) as net:
        a, b = net.hosts["a"], net.hosts["b"]
        server = b.popen([sys.executable, "-c", LISTEN, b.address], stdout=subprocess.PIPE,
                         text=True)
        assert server.stdout is not None and server.stdout.readline().strip() == "up"

        def probe() -> str:
            return subprocess.run(a.argv([sys.executable, "-c", PROBE, b.address]),
                                  capture_output=True, text=True, timeout=30).stdout.strip()

        assert probe() == "reached"
        b.blackhole()
        assert probe() == "TimeoutError"  # silent: no RST, no ICMP
        b.heal()
        assert probe() == "reached"
        b.down()
        assert probe() == "TimeoutError"
        b.heal()
        assert probe() == "reached"


def test_entered_runs_this_thread_on_the_host_and_always_comes_back(netns_ok: None) -> None:
    """`Host.entered` (the real-server tests run their trainer so): inside, this thread
    binds the host's address, and threads it starts are there too; after the block,
    also one that failed, the thread is back where it was."""
    import os
    import socket

    def here() -> str:
        return os.readlink("/proc/thread-self/ns/net")

    before = here()
    with Network(["a", "b"]) as net:
        a = net.hosts["a"]
        with pytest.raises(RuntimeError, match="inside"), a.entered():
            assert here() != before
            with socket.socket() as s:
                s.bind((a.address, 0))  # only an address of this host can be bound
            seen: list[str] = []
            t = threading.Thread(target=lambda: seen.append(here()))
            t.start()
            t.join(10)
            assert seen == [here()]
            raise RuntimeError("inside")
        assert here() == before
        with socket.socket() as s, pytest.raises(OSError):
            s.bind((a.address, 0))
