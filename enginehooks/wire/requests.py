"""A typed request per verb (`JoinRequest`, `LeaveRequest`, `CheckRequest`,
`ReceiveRequest`, `DigestsRequest`, `FlushRequest`, `InfoRequest`): the handle builds the
RPC's arguments from one (`args()`), the worker decodes them into the same class
(`from_args`, what `engine.contract.dispatch` runs), and the token signs its `payload()`.
A join's group size is checked here too (`check_world`), saying the fix.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from enginehooks.core.errors import ConfigError
from enginehooks.wire.payloads import signed_payload


# -- typed requests ----------------------------------------------------------------------
def _json_value(v: Any) -> Any:
    """A JSON argument that may arrive already decoded or as JSON text (HTTP)."""
    return json.loads(v) if isinstance(v, (str, bytes)) else v


def _text(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def _object(v: Any) -> dict[str, Any]:
    out = _json_value(v)
    if not isinstance(out, dict):
        raise ValueError(f"expected a JSON object, got {type(out).__name__}")
    return out


def _names(v: Any) -> list[str]:
    out = _json_value(v)
    if not isinstance(out, list) or not all(isinstance(n, str) for n in out):
        raise ValueError("expected a JSON list of tensor names")
    return out


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ValueError(f"expected an integer, got {type(v).__name__}")
    return int(v)


def _flag(v: Any) -> bool | None:
    """An optional yes/no argument, as JSON or as text from the network."""
    if v in (None, "", "None", "null"):
        return None
    if isinstance(v, bool):
        return v
    if v in ("true", "True", "1", 1):
        return True
    if v in ("false", "False", "0", 0):
        return False
    raise ValueError(f"expected true or false, got {v!r:.40}")


def _token(v: Any) -> str | None:
    return None if v in (None, "", "None", "null") else _text(v)


@dataclass(frozen=True)
class Request:
    """One verb's arguments. Fields in the order the RPC carries them (and the worker's
    `EngineSide` method takes them); the trailing `auth` (or a leave's message) is
    optional on the wire."""

    verb: ClassVar[str] = ""
    #: decoders of the wire arguments, in field order; `required` of them must be sent
    decoders: ClassVar[tuple[Callable[[Any], Any], ...]] = ()
    required: ClassVar[int] = 0

    def args(self) -> tuple[Any, ...]:
        """The RPC's arguments (JSON text for objects; an absent optional one left out)."""
        out = [json.dumps(v) if isinstance(v, (dict, list)) else v for v in self.values()]
        while len(out) > self.required and out[-1] is None:
            out.pop()
        return tuple(out)

    def values(self) -> list[Any]:
        return [getattr(self, f.name) for f in fields(self)]

    @classmethod
    def from_args(cls, args: Sequence[Any]) -> Request:
        """Decode an RPC's raw arguments (possibly JSON text); `ConfigError` otherwise."""
        if not cls.required <= len(args) <= len(cls.decoders):
            raise ConfigError(f"enginehooks_{cls.verb} takes {cls.required} to "
                              f"{len(cls.decoders)} arguments, got {len(args)}")
        try:
            decoded = [d(a) for d, a in zip(cls.decoders, args)]
        except (TypeError, ValueError) as e:  # arguments arrive as text from the network
            raise ConfigError(f"enginehooks_{cls.verb}: malformed argument "
                              f"({type(e).__name__}: {e})") from e
        return cls(*decoded)


@dataclass(frozen=True)
class InfoRequest(Request):
    """`needs`: also the byte runs the worker's loader reads (shard-direct schedules)."""

    verb: ClassVar[str] = "info"
    decoders: ClassVar[tuple[Callable[[Any], Any], ...]] = (_flag,)
    needs: bool | None = None


@dataclass(frozen=True)
class JoinRequest(Request):
    """Join the sender's group (`endpoint`, with `world_size`) as ranks from `rank_offset`."""

    verb: ClassVar[str] = "join"
    decoders: ClassVar[tuple[Callable[[Any], Any], ...]] = (_object, _int, _token)
    required: ClassVar[int] = 2
    endpoint: dict[str, Any]
    rank_offset: int
    auth: str | None = None

    def payload(self) -> str:
        return signed_payload("join", endpoint=self.endpoint, rank_offset=self.rank_offset)


@dataclass(frozen=True)
class LeaveRequest(Request):
    """Leave a group: `message` is a `leave_message` (group and token) or a bare token."""

    verb: ClassVar[str] = "leave"
    decoders: ClassVar[tuple[Callable[[Any], Any], ...]] = (_token,)
    message: str | None = None


@dataclass(frozen=True)
class CheckRequest(Request):
    """Validate `manifest` (JSON text) against the engine's loader; nothing moves."""

    verb: ClassVar[str] = "check"
    decoders: ClassVar[tuple[Callable[[Any], Any], ...]] = (_text, _token)
    required: ClassVar[int] = 1
    manifest: str
    auth: str | None = None

    def payload(self) -> str:
        return signed_payload("check", manifest=self.manifest)


@dataclass(frozen=True)
class ReceiveRequest(Request):
    """Take and apply the update `manifest` from the sender of `group`."""

    verb: ClassVar[str] = "receive"
    decoders: ClassVar[tuple[Callable[[Any], Any], ...]] = (_text, _text, _token)
    required: ClassVar[int] = 2
    manifest: str
    group: str
    auth: str | None = None

    def payload(self) -> str:
        return signed_payload("receive", manifest=self.manifest, group=self.group)


@dataclass(frozen=True)
class DigestsRequest(Request):
    """crc32 of the named weights (read-only; capped by the worker)."""

    verb: ClassVar[str] = "digests"
    decoders: ClassVar[tuple[Callable[[Any], Any], ...]] = (_names,)
    required: ClassVar[int] = 1
    names: list[str]


@dataclass(frozen=True)
class FlushRequest(Request):
    verb: ClassVar[str] = "flush"
    decoders: ClassVar[tuple[Callable[[Any], Any], ...]] = (_token,)
    auth: str | None = None


#: verb -> its request class
REQUESTS: dict[str, type[Request]] = {c.verb: c for c in (
    InfoRequest, JoinRequest, LeaveRequest, CheckRequest, ReceiveRequest, DigestsRequest,
    FlushRequest)}


# -- join -------------------------------------------------------------------------------
WORLD_FIX = ("the group's world size is the sender plus every worker of every replica "
             "(vLLM's EnginehooksTrainerInitInfo(world_size=1 + workers); WeightSync counts "
             "them from each replica's info)")


def check_world(world_size: Any, rank_offset: int, worker_rank: int,
                replica_workers: int | None, expected_workers: int | None) -> None:
    """Refuse a join whose group cannot be formed, saying the fix: this worker's rank is
    outside the world size, or the trainer counts `expected_workers` for this replica
    where it runs `replica_workers` (either may be unknown: None)."""
    rank = rank_offset + worker_rank
    if world_size is not None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
            raise ConfigError(f"join refused: world_size {world_size!r} is not an int >= 2; "
                              f"{WORLD_FIX}")
        if rank >= world_size:
            raise ConfigError(f"join refused: this worker would be rank {rank} of a group of "
                              f"world_size {world_size}, which has room for ranks 1.."
                              f"{world_size - 1} only; {WORLD_FIX}")
    if (replica_workers is not None and expected_workers is not None
            and replica_workers != expected_workers):
        raise ConfigError(f"join refused: the trainer counts {expected_workers} worker(s) for "
                          f"this replica, which runs {replica_workers}: set world_size to "
                          f"{rank_offset + replica_workers} for one replica; {WORLD_FIX}")
