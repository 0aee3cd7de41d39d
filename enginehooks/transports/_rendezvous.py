"""Process groups of our own, built from a TCPStore rendezvous.

The trainer usually owns torch.distributed's default group already; a weight-sync
group must never touch it. So groups here are constructed directly from a store
(`ProcessGroupGloo(store, rank, size, options)`, likewise NCCL) and live only as long
as the transport that made them. Every step has a timeout: a missing peer becomes an
error naming the rendezvous, never a hang.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import logging
import os
import socket
import time
from typing import Any

import torch.distributed as dist

from enginehooks.core.auth import AuthError
from enginehooks.core.errors import TransportError

log = logging.getLogger("enginehooks.transport")

#: The least time a party is given to connect to a store, whatever the group's timeout.
#: torch's TCPStore formats every peer address with `getnameinfo()`; for the
#: IPv4-mapped IPv6 addresses its clients connect through, glibc asks DNS (a PTR query
#: that /etc/hosts cannot answer), and a resolver that drops the query stalls the
#: connect for the resolver's own timeout (5 s per try with glibc's defaults; on our CI
#: machines one connect in about 50 stalls so). A short data-plane timeout must not turn
#: that into a failed group; an unreachable store is still reported, after this long.
#: Override per group with the transport option `connect_timeout_s`.
CONNECT_TIMEOUT_FLOOR_S = 30.0


def _td(seconds: float) -> _dt.timedelta:
    return _dt.timedelta(seconds=seconds)


def connect_timeout(timeout_s: float, connect_timeout_s: float | None = None) -> float:
    """How long joining a group may take: `connect_timeout_s` if given, else the group's
    timeout but at least `CONNECT_TIMEOUT_FLOOR_S`."""
    if connect_timeout_s is not None:
        return float(connect_timeout_s)
    return max(float(timeout_s), CONNECT_TIMEOUT_FLOOR_S)


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on `host` only. TCPStore's own server listens on every
    interface; ours is handed its socket, so the default `127.0.0.1` means loopback
    only, and peers arrive as plain IPv4 addresses (no DNS lookup in the server's loop,
    which would stall every party of the store at once)."""
    errors = []
    for family, kind, proto, _, addr in socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE | socket.AI_NUMERICSERV
    ):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(socket.SOMAXCONN)
            return sock
        except OSError as e:
            sock.close()
            errors.append(f"{addr}: {e}")
    raise OSError(f"no address of {host!r} could listen on port {port}: {'; '.join(errors)}")


def master_store(
    host: str, port: int, timeout_s: float, connect_timeout_s: float | None = None
) -> dist.TCPStore:
    """The sender's store, listening on `host` only. `port=0` picks a free port; read it
    back from `.port`. Operations time out after `timeout_s`."""
    try:
        with _listen(host, port) as sock:
            port = sock.getsockname()[1]
            # The store owns (and closes) a duplicate; ours closes when this block ends.
            store = dist.TCPStore(
                host, port, is_master=True, wait_for_workers=False,
                timeout=_td(connect_timeout(timeout_s, connect_timeout_s)),
                use_libuv=True, master_listen_fd=os.dup(sock.fileno()),
            )
    except Exception as e:
        raise TransportError(f"cannot open the rendezvous store on {host}:{port}: {e}") from e
    store.set_timeout(_td(timeout_s))
    return store


def client_store(
    host: str, port: int, timeout_s: float, connect_timeout_s: float | None = None
) -> dist.TCPStore:
    """A connection to a sender's store; operations time out after `timeout_s`."""
    limit = connect_timeout(timeout_s, connect_timeout_s)
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=_td(limit))
    except Exception as e:
        raise TransportError(
            f"cannot reach the rendezvous store at {host}:{port} within {limit}s: {e}"
        ) from e
    store.set_timeout(_td(timeout_s))
    return store


#: The environment variable that names the interface(s) a gloo device binds (torch's
#: own name for it; a comma-separated list gives one device per interface).
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"

_WILDCARDS = {"", "0.0.0.0", "::", "*"}


def local_address(peer_host: str, peer_port: int = 9) -> str:
    """This machine's address on the route that reaches `peer_host`.

    A connected UDP socket makes the kernel choose the route and the source address
    without sending a packet. Toward `127.0.0.1` it is `127.0.0.1`; toward a trainer on
    another host it is this host's address on the interface that reaches it."""
    errors = []
    try:
        infos = socket.getaddrinfo(peer_host, peer_port, type=socket.SOCK_DGRAM)
    except OSError as e:
        raise TransportError(f"cannot resolve the rendezvous host {peer_host!r}: {e}") from e
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as sock:
            try:
                sock.connect(addr)
                return str(sock.getsockname()[0])
            except OSError as e:
                errors.append(f"{addr[0]}: {e}")
    raise TransportError(
        f"no route from this host to the rendezvous host {peer_host!r} ({'; '.join(errors)}): "
        f"check the trainer's address, or name this host's interface with {GLOO_IFNAME_ENV}")


def gloo_devices(peer_host: str, peer_port: int = 9) -> list[Any]:
    """The gloo devices of this process for a group that meets at `peer_host`: each side
    binds an address of its own machine and tells its peers that one through the store.

    - `GLOO_SOCKET_IFNAME` set (e.g. `eth1`, or `eth1,eth2`): those interfaces;
    - otherwise this host's address on the route to `peer_host` (`local_address`): the
      trainer's own address on the trainer, the engine host's address on an engine host.

    The trainer's address is never bound by a receiver: only the trainer's machine has
    it (gloo said "Cannot resolve <trainer ip> to a (local) address")."""
    create = dist.ProcessGroupGloo.create_device
    names = [n.strip() for n in os.environ.get(GLOO_IFNAME_ENV, "").split(",") if n.strip()]
    if names:
        devices = []
        for name in names:
            try:
                devices.append(create(interface=name))
            except Exception as e:
                raise TransportError(
                    f"{GLOO_IFNAME_ENV}={os.environ[GLOO_IFNAME_ENV]!r}: no usable interface "
                    f"{name!r} on this host ({e}); name an interface of this machine (`ip "
                    f"addr`), or unset it to use the one that reaches the trainer") from e
        return devices
    if peer_host in _WILDCARDS:
        raise TransportError(
            f"rendezvous host {peer_host!r} is a wildcard: receivers connect to it and the "
            f"sender's gloo device binds it, so pass the trainer's address that the engines "
            f"reach (e.g. WeightSync(host='10.0.0.5')), or set {GLOO_IFNAME_ENV}")
    addr = local_address(peer_host, peer_port)
    try:
        return [create(hostname=addr)]
    except Exception as e:
        raise TransportError(
            f"cannot build a gloo device on {addr} (this host's address toward the rendezvous "
            f"host {peer_host!r}): {e}; set {GLOO_IFNAME_ENV} to the interface that reaches "
            f"the trainer") from e


# -- signed store keys ------------------------------------------------------------------
# Anyone who reaches a store's port can read and write its keys. With a shared secret,
# every key enginehooks writes into a store carries an HMAC-SHA256 suffix
# (`<body>\nmac=<hex>`) bound to the group, the kind of message, the update, the index,
# the audience and the direction (`control_mac`), so a message is valid under one key
# only. A reader that finds a message that does not verify logs it and keeps waiting
# for the genuine one until its deadline: a forged key is noise, never an instruction
# (and never a reason to end the update early). Without a secret messages are bare.

#: What separates a message's body from its MAC on the wire (`<body>\nmac=<64 hex>`).
MAC_SEP = b"\nmac="
#: Directions a control message is bound to.
TO_ENGINE, TO_TRAINER, TRAINER_SELF = "trainer->engine", "engine->trainer", "trainer->trainer"
#: The audience of a key that every member of the group reads.
EVERY_RECEIVER = "*"
#: How often a reader looks again at a key that held a message that did not verify.
RECHECK_S = 0.05


class ControlMessageRefused(AuthError, TransportError):
    """A control message in a rendezvous store (an ack, a ready/abort, a buffer
    descriptor, an arrival, a call-off) was unsigned or its MAC did not verify: forged
    by a process that reached the store, moved from another key, or written by a side
    without the shared secret. Readers ignore such a message and keep waiting for the
    genuine one (`ControlChannel.open` raises it; the waits catch it)."""


def control_mac(secret: bytes, *, group: str, kind: str, seq: int, index: int,
                audience: int | str, direction: str, body: bytes) -> str:
    """HMAC-SHA256 of one control message, bound to everything that says where it
    belongs: a message valid for one key verifies under no other."""
    head = (f"enginehooks-colocated/1\n{group}\n{kind}\n{seq}\n{index}\n{audience}\n"
            f"{direction}\n").encode()
    return hmac.new(secret, head + body, hashlib.sha256).hexdigest()


class ControlChannel:
    """Seals and opens the control messages of one group (every side uses it).

    `seal` appends the MAC when a secret is set, and returns the body unchanged when
    not. `open` returns the body, raising `ControlMessageRefused` (naming the key) when
    a secret is set and the MAC is missing or wrong. Key names are the caller's
    (`key`, the colocated transports' layout, is the default)."""

    def __init__(self, secret: bytes | None, group: str, prefix: str, who: str) -> None:
        self.secret, self.group, self.prefix, self.who = secret, group, prefix, who

    def key(self, kind: str, seq: int, index: int, audience: int | str) -> str:
        if kind == "buffers":
            return f"{self.prefix}buffers/{index}"
        if kind == "ready":
            return f"{self.prefix}u{seq}/ready/{index}"
        if kind in ("join", "arrived"):
            return f"{self.prefix}{kind}/{index}"
        if kind == "abort":
            return f"{self.prefix}abort"
        return f"{self.prefix}u{seq}/ack/{index}/{audience}"

    def seal(self, kind: str, seq: int, index: int, audience: int | str, direction: str,
             body: bytes) -> bytes:
        if self.secret is None:
            return body
        mac = control_mac(self.secret, group=self.group, kind=kind, seq=seq, index=index,
                          audience=audience, direction=direction, body=body)
        return body + MAC_SEP + mac.encode()

    def open(self, kind: str, seq: int, index: int, audience: int | str,
             directions: tuple[str, ...], raw: bytes) -> bytes:
        body, sep, mac = raw.rpartition(MAC_SEP)
        signed = bool(sep) and len(mac) == 64
        if not signed:
            body = raw
        if self.secret is None:
            return body  # nothing to check against (see the comment above)
        key = self.key(kind, seq, index, audience)
        if not signed:
            raise ControlMessageRefused(
                f"{self.who}: control message {key} is not signed with the shared secret "
                f"(forged by a process that reached the rendezvous store, or the other side "
                f"runs without ENGINEHOOKS_SECRET: set the same secret on the trainer and "
                f"every engine)")
        for direction in directions:
            want = control_mac(self.secret, group=self.group, kind=kind, seq=seq, index=index,
                               audience=audience, direction=direction, body=body)
            if hmac.compare_digest(mac, want.encode()):
                return body
        raise ControlMessageRefused(
            f"{self.who}: control message {key} does not verify with the shared secret "
            f"(forged, moved from another key, or signed with another secret: the trainer "
            f"and every engine need the same ENGINEHOOKS_SECRET)")


class Ignored:
    """The messages a reader refused while it waited (logged once each): what its
    timeout error reports, so an update ended by forged keys says so."""

    def __init__(self) -> None:
        self.seen: dict[str, set[bytes]] = {}

    def note(self, key: str, raw: bytes, e: ControlMessageRefused) -> None:
        seen = self.seen.setdefault(key, set())
        if raw not in seen and len(seen) < 64:
            seen.add(raw)
            log.warning("enginehooks: ignored a control message that does not verify, still "
                        "waiting for the genuine one: %s", e)

    def __bool__(self) -> bool:
        return bool(self.seen)

    def says(self) -> str:
        if not self.seen:
            return ""
        keys = sorted(self.seen)
        return (f"; {sum(len(v) for v in self.seen.values())} message(s) that did not verify "
                f"were ignored at {keys[:4]} (written by a process that reached the "
                f"rendezvous store, or by a side without the same ENGINEHOOKS_SECRET)")


# Store keys of a group's arrival barrier (under the group's prefix): `arrived/<rank>`
# (each rank's own, signed by it) and `abort` (the sender's call-off, signed by it).
ARRIVED_KEY, ABORT_KEY = "arrived", "abort"
ARRIVAL_POLL_S = 0.05


def barrier_key(prefix: str, name: str) -> str:
    """The full store key of barrier key `name` (`arrived/<rank>`, `abort`) of the group
    under `prefix`: torch's `PrefixStore` joins its prefix and a key with a "/"."""
    return f"{prefix}/{name}"


def _barrier(prefix: str, secret: bytes | None, rank: int) -> ControlChannel:
    return ControlChannel(secret, prefix, barrier_key(prefix, ""), f"group {prefix!r} rank {rank}")


def arrive(store: dist.Store, prefix: str, world_size: int, timeout_s: float,
           rank: int = 0, secret: bytes | None = None) -> None:
    """Wait until every rank of the group has arrived, or the sender called the group off
    (`call_off`). A replica that refuses its join never arrives: the coordinator calls
    the group off at once, and every rank already waiting here (the trainer's and the
    healthy replicas') ends now with the reason, instead of blocking in the process
    group's constructor until its timeout. With a `secret`, each rank's arrival and the
    call-off are signed; one that does not verify is ignored (logged), so a process that
    reached the store can neither end the wait nor fake a rank's arrival."""
    pstore = dist.PrefixStore(prefix, store)
    channel = _barrier(prefix, secret, rank)
    pstore.set(f"{ARRIVED_KEY}/{rank}", channel.seal(  # type: ignore[arg-type]
        "arrived", 0, rank, rank, TO_TRAINER if rank else TRAINER_SELF, b"1"))
    keys = [f"{ARRIVED_KEY}/{r}" for r in range(world_size)]
    ignored = Ignored()
    arrived: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while True:
        if pstore.check([ABORT_KEY]):
            raw = pstore.get(ABORT_KEY)
            try:
                reason = channel.open("abort", 0, 0, EVERY_RECEIVER, (TO_ENGINE,), raw)
            except ControlMessageRefused as e:
                ignored.note(barrier_key(prefix, ABORT_KEY), raw, e)
            else:
                raise TransportError(f"group {prefix!r} was called off by the sender: "
                                     f"{reason.decode('utf-8', 'replace')}")
        missing = [r for r in range(world_size) if r not in arrived]
        # one round trip a poll: read (and verify) the missing keys once all are there
        if pstore.check([keys[r] for r in missing]):
            for r, raw in zip(missing, pstore.multi_get([keys[r] for r in missing])):
                try:
                    channel.open("arrived", 0, r, r, (TO_TRAINER, TRAINER_SELF), raw)
                except ControlMessageRefused as e:
                    ignored.note(barrier_key(prefix, keys[r]), raw, e)
                else:
                    arrived.add(r)
        if len(arrived) >= world_size:
            return
        if time.monotonic() >= deadline:
            for r in (r for r in range(world_size) if r not in arrived):  # who did come
                if pstore.check([keys[r]]):
                    try:
                        channel.open("arrived", 0, r, r, (TO_TRAINER, TRAINER_SELF),
                                     pstore.get(keys[r]))
                        arrived.add(r)
                    except ControlMessageRefused as e:
                        ignored.note(barrier_key(prefix, keys[r]), pstore.get(keys[r]), e)
            raise TransportError(f"group {prefix!r} did not form within {timeout_s}s: "
                                 f"{len(arrived)} of {world_size} ranks arrived"
                                 f"{ignored.says()}")
        time.sleep(ARRIVAL_POLL_S)  # a store poll: bounded by the deadline above


def call_off(store: dist.Store, prefix: str, reason: str, secret: bytes | None = None) -> None:
    """End the arrival wait of every rank of the group, with `reason` (signed with
    `secret` when there is one: only the sender's call-off is obeyed)."""
    channel = _barrier(prefix, secret, 0)
    dist.PrefixStore(prefix, store).set(ABORT_KEY, channel.seal(  # type: ignore[arg-type]
        "abort", 0, 0, EVERY_RECEIVER, TO_ENGINE, reason[:2000].encode()))


def new_group(
    backend: str,
    store: dist.Store,
    prefix: str,
    rank: int,
    world_size: int,
    timeout_s: float,
    host: str | None = None,
    secret: bytes | None = None,
) -> dist.ProcessGroupGloo | dist.ProcessGroupNCCL:
    """A `Backend` object for `backend` ("gloo" or "nccl") over `store` under `prefix`.

    `host` is where the store listens (default: the store's own host), used only to
    find the interface this process binds (`gloo_devices`). NCCL picks its interfaces
    itself (`NCCL_SOCKET_IFNAME` names them).

    Blocks until every rank has joined, or raises after `timeout_s` or as soon as the
    sender calls the group off (`arrive`; its keys signed with `secret`, if any).
    """
    arrive(store, prefix, world_size, timeout_s, rank, secret)
    pstore = dist.PrefixStore(prefix, store)
    store_host = host if host is not None else str(getattr(store, "host", "127.0.0.1"))
    store_port = int(getattr(store, "port", 0) or 9)
    if backend == "gloo":
        devices = gloo_devices(store_host, store_port)
    try:
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private
            opts._timeout = _td(timeout_s)
            opts._devices = devices
            return dist.ProcessGroupGloo(pstore, rank, world_size, opts)
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = _td(timeout_s)
            return dist.ProcessGroupNCCL(pstore, rank, world_size, opts)
    except Exception as e:
        raise TransportError(
            f"{backend} group {prefix!r} (rank {rank} of {world_size}) did not form within "
            f"{timeout_s}s: {e}"
        ) from e
    raise TransportError(f"unknown process-group backend {backend!r}")
