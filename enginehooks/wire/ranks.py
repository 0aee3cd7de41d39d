"""The messages between trainer ranks (`trainer_side/channel.py` carries them): lockstep
flags (`Go`, `Stop`, in a fixed-size `frame`) and the commands of several senders
(`Plan`, `Reuse`, `Open`, `Connect`, `Send`, `Close`, `End`, `Bye`) with the ranks'
`Answer`s.

Each is a small frozen dataclass with `to_json` / `from_json`: plain JSON text with an
`"op"` naming its class, every field checked against its declared JSON type; bytes that
do not parse into one of them are refused (`MalformedMessage`), never guessed at and
never unpickled.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from enginehooks.core.errors import TransportError
from enginehooks.core.manifest import TensorSpec

#: The size of one lockstep flag (`frame`): a reason is cut to fit.
FLAG_BYTES = 256


class MalformedMessage(TransportError):
    """Bytes on the trainer ranks' channel that are not one of its messages: the ranks
    do not run the same enginehooks code."""


# -- the messages -------------------------------------------------------------------------
@dataclass(frozen=True)
class Message:
    """Base of every message; `op` names the class on the wire."""

    op: ClassVar[str] = ""
    _types: ClassVar[dict[str, type[Message]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.op:
            Message._types[cls.op] = cls

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, **asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @staticmethod
    def from_dict(raw: Any) -> Message:
        """The message `raw` (a decoded JSON object) is; `MalformedMessage` if none."""
        op = raw.get("op") if isinstance(raw, dict) else None
        cls = Message._types.get(op) if isinstance(op, str) else None
        if cls is None:
            raise MalformedMessage(f"not a trainer-ranks message: {str(raw)[:200]}")
        values = {f.name: raw[f.name] for f in fields(cls) if f.name in raw}
        for f in fields(cls):
            if f.name in values and not _fits(values[f.name], str(f.type)):
                raise MalformedMessage(f"a malformed {cls.op!r} message: {f.name} is "
                                       f"{str(values[f.name])[:64]!r}, not {f.type}")
        try:
            return cls(**values)
        except (TypeError, ValueError) as e:
            raise MalformedMessage(f"a malformed {cls.op!r} message: {e}") from None

    @staticmethod
    def from_json(text: str | bytes) -> Message:
        try:
            raw = json.loads(text)
        except (ValueError, UnicodeDecodeError) as e:
            raise MalformedMessage(f"not a trainer-ranks message ({e}): {text[:64]!r}") from None
        return Message.from_dict(raw)


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "dict": (dict,),
    "list": (list,), "None": (type(None),)}


def _fits(value: Any, annotation: str) -> bool:
    """Whether a JSON value is of a field's declared type (its outer types: `int`,
    `str | None`, `dict[...]`), which is all a message's fields need."""
    options, depth, start = [], 0, 0
    for i, c in enumerate(annotation):
        depth += (c == "[") - (c == "]")
        if c == "|" and depth == 0:
            options.append(annotation[start:i])
            start = i + 1
    options.append(annotation[start:])
    for option in options:
        types = _JSON_TYPES.get(option.split("[", 1)[0].strip())
        if types is None:
            return True  # a field typed beyond JSON's: its class checks it
        if isinstance(value, types) and not (isinstance(value, bool) and bool not in types):
            return True
    return False


@dataclass(frozen=True)
class Go(Message):
    """Lockstep: stream position `index` of `count` may be gathered (`fingerprint` of
    the sender's stream, `dtype` the wire dtype, '' for per-tensor dtypes)."""

    op: ClassVar[str] = "go"
    index: int
    count: int
    fingerprint: int
    dtype: str = ""


@dataclass(frozen=True)
class Stop(Message):
    """Lockstep: the push is off at stream position `index`, for `reason`."""

    op: ClassVar[str] = "stop"
    index: int
    reason: str = ""


@dataclass(frozen=True)
class Plan(Message):
    """Several senders: say which tensors you can stream, in these wire dtypes (names as
    `core/dtypes.dtype_name` writes them; per-tensor exceptions in `dtypes`)."""

    op: ClassVar[str] = "plan"
    dtype: str | None = None
    dtypes: dict[str, str | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Reuse(Message):
    """Several senders: is your part of prepared layout `layout` still yours (your model's
    layout key the kept one's, its plan taken over, your sender intact)? Answer `ok`, or
    not with the reason (`broken`: your sender's group is gone). A rank that answers `ok`
    holds the plan ready for a `Send` that names the layout (`core/layout.reference`)."""

    op: ClassVar[str] = "reuse"
    layout: str


@dataclass(frozen=True)
class Open(Message):
    """Several senders: open your sender and answer its endpoint."""

    op: ClassVar[str] = "open"


@dataclass(frozen=True)
class Connect(Message):
    """Several senders: form your group of `world` members."""

    op: ClassVar[str] = "connect"
    world: int


@dataclass(frozen=True)
class Send(Message):
    """Several senders: send your part of `manifest` (the signed manifest's JSON, or the
    reference to a prepared layout that this rank answered `Reuse` for)."""

    op: ClassVar[str] = "send"
    manifest: str


@dataclass(frozen=True)
class Close(Message):
    """Several senders: close your sender."""

    op: ClassVar[str] = "close"


@dataclass(frozen=True)
class End(Message):
    """Several senders: the push is over, `ok` or failed with `error`."""

    op: ClassVar[str] = "end"
    ok: bool
    error: str | None = None


@dataclass(frozen=True)
class Bye(Message):
    """Several senders: the coordinator closed; stop serving."""

    op: ClassVar[str] = "bye"


@dataclass(frozen=True)
class Answer(Message):
    """A rank's answer to a command: `ok`, or the `error`; what the command asked for
    (`specs` as `[name, dtype, shape]` triples, `endpoint`, the part's `seconds` and
    `bytes`; `broken`: to a `Reuse`, this rank's sender group is gone)."""

    op: ClassVar[str] = "answer"
    ok: bool = True
    error: str | None = None
    specs: list[list[Any]] | None = None
    endpoint: dict[str, Any] | None = None
    seconds: float | None = None
    bytes: int | None = None
    broken: bool = False

    @staticmethod
    def of_specs(specs: list[TensorSpec]) -> Answer:
        return Answer(specs=[[s.name, s.dtype, list(s.shape)] for s in specs])

    def tensor_specs(self, rank: int) -> list[TensorSpec]:
        """`specs` as `TensorSpec`s; rank `rank` sent them."""
        try:
            return [TensorSpec(str(n), str(d), tuple(int(x) for x in shape))
                    for n, d, shape in self.specs or []]
        except (TypeError, ValueError) as e:
            raise MalformedMessage(f"trainer rank {rank} sent a malformed plan: {e}") from None


#: every command trainer rank 0 sends to the other senders
Command = Plan | Reuse | Open | Connect | Send | Close | End | Bye


def frame(message: Message, size: int = FLAG_BYTES) -> bytes:
    """`message` in a fixed-size frame (zero padded); a `Stop`'s reason is cut to fit."""
    data = message.to_json().encode()
    if len(data) > size and isinstance(message, Stop):
        lo, hi = 0, len(message.reason)  # the longest prefix of the reason that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(Stop(message.index, message.reason[:mid]).to_json().encode()) <= size:
                lo = mid
            else:
                hi = mid - 1
        data = Stop(message.index, message.reason[:lo]).to_json().encode()
    if len(data) > size:
        raise MalformedMessage(f"a {message.op!r} message of {len(data)} bytes does not fit "
                               f"a frame of {size}")
    return data.ljust(size, b"\0")


def unframe(raw: bytes) -> Message:
    return Message.from_json(raw.rstrip(b"\0"))


