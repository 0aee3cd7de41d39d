"""What every transport provides: a sender half, a receiver half, and the group between.

A transport is registered by name through the `register_transports` hook. The trainer
side opens a `Sender` (which owns the rendezvous and describes it as a JSON-able
`endpoint`); each engine worker opens a `Receiver` from that endpoint and its rank.
Nothing here knows about engines: a receiver hands tensors (or a folder) to a
`Target`, the engine plugin's object that applies them.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from enginehooks.core.errors import EngineHooksError, PeerLost, TransferStalled, TransportError
from enginehooks.core.landing import WireLanding
from enginehooks.core.manifest import Manifest

if TYPE_CHECKING:
    import pluggy

Stream = Iterable[tuple[str, torch.Tensor]]


class Target(ABC):
    """The receiving end inside an engine worker (each engine plugin supplies one):
    applies an update's tensors with the engine's own load path."""

    device: torch.device

    @abstractmethod
    def apply(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Load every tensor of the iterator into the model (one reload per update).
        Tensors may be views of a transport buffer, valid until the next is pulled."""

    def prepare(self, manifest: Manifest) -> None:  # noqa: B027 - optional
        """Called with the update's manifest before its bytes move (its `meta` carries
        the trainer's requests, e.g. `verify`)."""

    def load_path(self, path: str) -> bool:
        """Reload from a folder of safetensors shards with the engine's own loader.
        Returns False when the engine has no such path; the caller then streams."""
        return False

    def destination(self, name: str) -> torch.Tensor | None:
        """The tensor a received weight ends up in, if the target holds it in checkpoint
        layout: receivers then rejoin a tensor cut across buckets straight into it,
        with no full-size temporary. None (the default): a temporary is used."""
        return None

    def destinations(self, names: Sequence[str]) -> list[torch.Tensor | None]:
        """`destination` of each of `names`, in order: receivers ask for thousands at
        once (an MoE's experts), where a call per name costs microseconds each."""
        return [self.destination(n) for n in names]

    def landing_wanted(self) -> bool:
        """Whether this update proves what receivers land in `destination`s from their
        `WireLanding`s (verification runs): receivers then describe each landing, and
        land wherever they can. Default: no."""
        return False

    def wire_landed(self, landing: WireLanding) -> None:  # noqa: B027 - optional
        """Called by a receiver that copied pieces straight into `destination(name)`
        tensors in a pass that also summed what it read, before it yields those tensors
        (see `WireLanding`), where `landing_wanted()`. Default: ignored."""

    def arrived_piece(  # noqa: B027 - optional
            self, name: str, start: int, nbytes: int, checksum: str, digest: int) -> None:
        """Called by a receive loop that checked bytes [start, start + nbytes) of tensor
        `name`, arrived in a bucket of their own, against the sender's `digest`
        (algorithm `checksum`, over exactly those bytes) before it yields the tensor,
        where `landing_wanted()`: the digest of what arrived, known without reading it
        again. Default: ignored."""


@dataclass
class SendStats:
    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0
    # Transports may return a manifest completed during the send (disk: shard digests).
    manifest: Manifest | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Abort:
    """A one-shot failure signal the coordinator raises while a sender is mid-update.

    Senders wait on their own work *and* this signal together (a condition variable,
    no polling), so a replica that fails early ends the send at once instead of at
    the data plane's timeout.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self.error: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        with self._cv:
            if self.error is None:
                self.error = error
            self._cv.notify_all()

    def poke(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def wait_for(self, done: Callable[[], bool], timeout: float) -> bool:
        """Wait until `done()` or a failure; True if `done()` became true."""
        with self._cv:
            self._cv.wait_for(lambda: self.error is not None or done(), timeout)
            if self.error is not None:
                raise PeerLost(f"update aborted: {self.error}") from self.error
            return done()


#: What gloo and NCCL say when a peer closed or reset the connection. They raise a bare
#: `RuntimeError` (no class tells a lost peer from anything else), so this boundary is
#: the one place in the library that reads a third party's words to choose a class;
#: everything above it sees `PeerLost` / `TransferStalled` and never reads text.
_PEER_GONE_WORDS = ("closed by peer", "reset by peer", "connection closed", "broken pipe",
                    "socket closed", "connection refused")


def data_plane_error(e: BaseException, what: str) -> BaseException:
    """The error to raise for `e`, an exception out of torch.distributed (a collective,
    a store wait), as an enginehooks class: `PeerLost` for a peer that went away,
    `TransferStalled` for a wait that ran out of time, `TransportError` otherwise.
    Our own errors pass through unchanged."""
    if isinstance(e, EngineHooksError) or not isinstance(e, Exception):
        return e
    import torch.distributed as dist

    text = str(e).lower()
    if isinstance(e, dist.DistNetworkError) or any(w in text for w in _PEER_GONE_WORDS):
        return PeerLost(f"{what} failed: a peer went away ({e})")
    if isinstance(e, (TimeoutError, dist.DistStoreError)) or "timed out" in text or "timeout" in text:
        return TransferStalled(f"{what} did not complete: {e}")
    return TransportError(f"{what} failed: {e}")


@dataclass(frozen=True)
class GroupRequest:
    """What the `update_group` hook is asked to do, one frozen class per mode (a
    discriminated union, `GroupUpdate`): `JoinSender`, `JoinReceiver`, `LeaveSender`,
    `LeaveReceiver`. Each carries only what its mode needs, so no field "stays None"
    outside it, and each says what the hook answers for it (`ask`, typed per mode).
    `action` and `side` name the mode (for logging plugins); the constructors below
    build the four."""

    #: the registered transport's name
    transport: str
    action: ClassVar[Literal["join", "leave"]]
    side: ClassVar[Literal["sender", "receiver"]]

    @staticmethod
    def join_sender(transport: str, options: Mapping[str, Any]) -> JoinSender:
        return JoinSender(transport, dict(options))

    @staticmethod
    def join_receiver(transport: str, endpoint: Mapping[str, Any], rank: int,
                      device: str) -> JoinReceiver:
        return JoinReceiver(transport, dict(endpoint), rank, device)

    @staticmethod
    def leave(transport: str, side: Literal["sender", "receiver"],
              member: Sender | Receiver) -> LeaveSender | LeaveReceiver:
        """A leave of `member` on `side` (`LeaveSender` or `LeaveReceiver`)."""
        if side == "sender" and isinstance(member, Sender):
            return LeaveSender(transport, member)
        if side == "receiver" and isinstance(member, Receiver):
            return LeaveReceiver(transport, member)
        raise TransportError(f"a leave of the {side} side needs a {side.capitalize()}, "
                             f"not a {type(member).__name__}")


def _answer(request: GroupRequest, pm: pluggy.PluginManager, kind: type) -> Any:
    """The `update_group` hook's answer to `request`, checked to be the `kind` its mode
    has: a plugin that returned something else fails here, where it is known, instead of
    as a later AttributeError far from it."""
    out = pm.hook.update_group(request=request)
    if not isinstance(out, kind):
        raise TransportError(
            f"update_group({type(request).__name__}, transport {request.transport!r}) "
            f"answered {type(out).__name__}: an implementation returns the "
            f"{kind.__name__} it opened or closed")
    return out


@dataclass(frozen=True)
class JoinSender(GroupRequest):
    """Open the trainer's `Sender` of a group; the hook answers it."""

    action: ClassVar[Literal["join", "leave"]] = "join"
    side: ClassVar[Literal["sender", "receiver"]] = "sender"
    #: keyword options for `Transport.sender` (host, port, timeout_s, device, secret and
    #: `WeightSync(transport_options=...)`)
    options: Mapping[str, Any] = field(default_factory=dict)

    def ask(self, pm: pluggy.PluginManager) -> Sender:
        """The sender the `update_group` hook opens for this request."""
        return _answer(self, pm, Sender)


@dataclass(frozen=True)
class JoinReceiver(GroupRequest):
    """Open a worker's `Receiver` of the group at `endpoint` as global `rank` on
    `device`, connected; the hook answers it."""

    action: ClassVar[Literal["join", "leave"]] = "join"
    side: ClassVar[Literal["sender", "receiver"]] = "receiver"
    #: the sender's endpoint (`Sender.endpoint()`, with `world_size`)
    endpoint: Mapping[str, Any]
    rank: int
    device: str

    def ask(self, pm: pluggy.PluginManager) -> Receiver:
        """The connected receiver the `update_group` hook opens for this request."""
        return _answer(self, pm, Receiver)


@dataclass(frozen=True)
class LeaveSender(GroupRequest):
    """Close the trainer's `sender`; the hook answers the closed sender."""

    action: ClassVar[Literal["join", "leave"]] = "leave"
    side: ClassVar[Literal["sender", "receiver"]] = "sender"
    sender: Sender

    @property
    def member(self) -> Sender:
        """The half this leave closes (the same for either side)."""
        return self.sender

    def ask(self, pm: pluggy.PluginManager) -> Sender:
        """The sender the `update_group` hook closed."""
        return _answer(self, pm, Sender)


@dataclass(frozen=True)
class LeaveReceiver(GroupRequest):
    """Close a worker's `receiver`; the hook answers the closed receiver."""

    action: ClassVar[Literal["join", "leave"]] = "leave"
    side: ClassVar[Literal["sender", "receiver"]] = "receiver"
    receiver: Receiver

    @property
    def member(self) -> Receiver:
        """The half this leave closes (the same for either side)."""
        return self.receiver

    def ask(self, pm: pluggy.PluginManager) -> Receiver:
        """The receiver the `update_group` hook closed."""
        return _answer(self, pm, Receiver)


class Sender(ABC):
    """Trainer side of one transport group."""

    @property
    def broken(self) -> bool:
        """True once a failed collective left the group in an unknown state: the
        coordinator then rebuilds the group before the next push."""
        return False

    @abstractmethod
    def endpoint(self) -> dict[str, Any]:
        """JSON-able description receivers need to join (never secrets or pickles)."""

    @abstractmethod
    def connect(self, world_size: int) -> None:
        """Form the group with `world_size - 1` receivers (blocks, with the timeout)."""

    @abstractmethod
    def send(self, manifest: Manifest, stream: Stream, abort: Abort) -> SendStats:
        """Move every tensor of `stream` as `manifest` plans; raise on any failure."""

    def close(self) -> None:  # noqa: B027 - optional
        """Tear the group down; safe to call twice."""


class Receiver(ABC):
    """Engine side of one transport group, living in one engine worker."""

    @property
    def broken(self) -> bool:
        """True once a failed update left the group unusable (see `Sender.broken`)."""
        return False

    @abstractmethod
    def connect(self) -> None:
        """Join the group (blocks until it forms, or raises after the timeout)."""

    @abstractmethod
    def deliver(self, manifest: Manifest, target: Target) -> dict[str, Any]:
        """Receive the update described by `manifest` and hand it to `target`."""

    def close(self) -> None:  # noqa: B027 - optional
        """Leave the group; safe to call twice."""


class Transport(ABC):
    """A named way of moving an update. Subclasses set `name` and build the halves."""

    name: ClassVar[str]
    #: True: receivers take the data while the sender sends (a collective).
    #: False: the sender finishes first and receivers read what it left (disk).
    streaming: ClassVar[bool] = True
    #: Whether the manifest may cut tensors larger than a bucket into pieces.
    split: ClassVar[bool] = True
    #: Bucket digest used when `WeightSync(checksum="auto")`: a host hash for host
    #: buffers; GPU transports override it with one computed on the device.
    default_checksum: ClassVar[str | None] = "xxh3"
    #: Tensors of at least this many bytes (or filling a bucket) travel in direct
    #: buckets, sent from their own storage (`core/manifest.py`); None: this transport
    #: frames every bucket as one packed message.
    direct_min: ClassVar[int | None] = None
    #: `WeightSync`'s bucket size when none is given: what measured fastest for this
    #: transport (the GPU transports override it; docs/transports.md has the runs)
    default_bucket_bytes: ClassVar[int] = 256 << 20
    #: Whether several trainer ranks may each send a part of one update
    #: (`WeightSync(senders=...)`, `docs/scale.md`): each then opens a sender of its own,
    #: and a receiver accepts an endpoint that lists the senders' endpoints.
    several_senders: ClassVar[bool] = False
    #: Whether `WeightSync` plans a static shard-direct schedule for this transport (the
    #: `shard` transport, `transports/shard_direct.py`): it asks the engine workers'
    #: needs and writes the schedule into the manifest where it can.
    schedules: ClassVar[bool] = False

    @abstractmethod
    def sender(self, **options: Any) -> Sender:
        """Open the trainer side; `options` come from `WeightSync(transport_options=...)`
        plus host, port, timeout_s and device."""

    @abstractmethod
    def receiver(self, endpoint: dict[str, Any], rank: int, device: torch.device) -> Receiver:
        """Open the engine side for global rank `rank` (>= 1; the sender is 0)."""


#: What the `update_group` hook takes: one request per mode.
GroupUpdate = JoinSender | JoinReceiver | LeaveSender | LeaveReceiver
#: What it answers, per mode: the opened or closed half.
GroupResult = Sender | Receiver
