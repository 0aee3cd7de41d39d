"""The one channel between trainer ranks, and the typed messages it carries.

Trainer ranks talk to each other for two reasons, over one channel:

- **lockstep flags** (`trainer_side/lockstep.py`): before each tensor of a sharded
  stream the sender rank says `Go` (with the tensor index, the stream's fingerprint and
  the wire dtype) or `Stop` (with the reason), in one fixed-size frame (`flag`, one
  collective per tensor, on the group's own device), so that no rank enters a gather
  that its peers will never enter;
- **commands of several senders** (`control/senders.py`): trainer rank 0, which talks
  to the engines, tells the other sending ranks what to do next (`Plan`, `Open`,
  `Connect`, `Send`, `Close`, `End`, `Bye`) and gathers their `Answer`s.

Every message is a small dataclass with `to_json` / `from_json` (plain JSON text with an
`"op"` naming its class; never pickle, which `broadcast_object_list` would use); a
message that does not parse into one of them is refused (`MalformedMessage`). Messages
travel as byte tensors over a `torch.distributed` group of the trainer. Every wait of a
command is bounded; after a failed or timed-out command exchange the channel's state is
unknown and it is `broken` for good: every later call raises at once (a trainer that
lost a rank restarts its process group anyway). A failed flag is the lockstep's to
report (`LockstepError`).
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from enginehooks.core.errors import TransportError
from enginehooks.core.manifest import TensorSpec

#: The size of one short answer (`gather_short`): errors are cut to fit.
SHORT_BYTES = 8192
#: The size of one lockstep flag (`flag`): a reason is cut to fit.
FLAG_BYTES = 256


class RanksBroken(TransportError):
    """The trainer ranks' control channel failed (a rank died, or did not answer)."""


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
    """Several senders: send your part of `manifest` (the signed manifest's JSON)."""

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
    `bytes`)."""

    op: ClassVar[str] = "answer"
    ok: bool = True
    error: str | None = None
    specs: list[list[Any]] | None = None
    endpoint: dict[str, Any] | None = None
    seconds: float | None = None
    bytes: int | None = None

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
Command = Plan | Open | Connect | Send | Close | End | Bye


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


# -- the channel ----------------------------------------------------------------------------
class TrainerRanks:
    """Rank, size and channel of the trainer ranks of one group.

    Args:
        group: the `torch.distributed` group (None: the default group). Commands need one
            that supports CPU tensors (gloo, or a gloo side group of an NCCL job); flags
            travel on the group's own device.
        timeout_s: the longest one command exchange waits.
        root: the rank (within `group`) that speaks: the lockstep's sender, the
            coordinator of several senders (0).
    """

    def __init__(self, group: Any = None, timeout_s: float = 120.0, root: int = 0) -> None:
        self.active = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.active else 0
        self.size = dist.get_world_size(group) if self.active else 1
        self.root = root
        self.timeout_s = float(timeout_s)
        self.broken: str | None = None
        self.device = torch.device("cpu")
        if self.active and "gloo" not in str(dist.get_backend(group)):
            self.device = torch.device("cuda", torch.cuda.current_device())

    @property
    def coordinator(self) -> bool:
        return self.rank == self.root

    def global_rank(self, rank: int) -> int:
        """The default group's rank of this channel's rank `rank`."""
        if not self.active or self.group is None or self.group is dist.group.WORLD:
            return rank
        return int(dist.get_global_rank(self.group, rank))

    # -- lockstep flags -------------------------------------------------------------------
    def flag(self, message: Message | None, timeout_s: float | None) -> Message:
        """One fixed-size frame from the root (`message` there, None elsewhere), in one
        collective on the group's device; `timeout_s` None is the group's own timeout.
        The root gets its own `message` back without reading the buffer.
        A failed collective raises its `RuntimeError` (the lockstep reports it)."""
        buf = torch.zeros(FLAG_BYTES, dtype=torch.uint8)
        framed = frame(message) if message is not None else b""
        if message is not None:
            buf.copy_(torch.frombuffer(bytearray(framed), dtype=torch.uint8))
        buf = buf.to(self.device)
        opts = dist.BroadcastOptions()
        opts.rootRank = self.root
        if timeout_s is not None:
            opts.timeout = _dt.timedelta(seconds=timeout_s)
        group = self.group if self.group is not None else dist.group.WORLD
        if group is None:
            raise TransportError("no process group: initialise torch.distributed first")
        group.broadcast([buf], opts).wait()
        if message is not None:
            # the root knows what it sent: no copy back to the host (on NCCL a
            # `.cpu()` here would wait for the GPU on the sender's hot path)
            return unframe(framed)
        return unframe(bytes(buf.cpu().numpy().tobytes()))

    # -- commands -------------------------------------------------------------------------
    def _check(self) -> None:
        if self.broken is not None:
            raise RanksBroken(f"the trainer ranks' control channel is broken since: "
                              f"{self.broken}; rebuild the process group")

    def _wait(self, work: Any, what: str, timeout_s: float | None = None) -> None:
        t = self.timeout_s if timeout_s is None else timeout_s
        try:
            ok = work.wait(timeout=_dt.timedelta(seconds=t))
        except RuntimeError as e:
            self.broken = f"{what} (trainer rank {self.rank}): {e}"
            raise RanksBroken(self.broken) from e
        if ok is False:
            self.broken = f"{what} (trainer rank {self.rank}): no answer within {t}s"
            raise RanksBroken(self.broken)

    def start(self, work_of: Any, what: str) -> Any:
        """Issue one collective (`work_of()` returns its `Work`), marking the channel
        broken if it cannot even start."""
        self._check()
        try:
            return work_of()
        except RuntimeError as e:
            self.broken = f"{what} (trainer rank {self.rank}): {e}"
            raise RanksBroken(self.broken) from e

    def broadcast(self, message: Message | None = None,
                  timeout_s: float | None = None) -> Message | None:
        """The root's `message` on every rank (any size: two collectives)."""
        n = torch.zeros(1, dtype=torch.int64)
        data = b""
        if self.coordinator:
            data = message.to_json().encode() if message is not None else b""
            n[0] = len(data)
        self._wait(self.start(lambda: dist.broadcast(n, group=self.group, group_src=self.root,
                                                     async_op=True), "control broadcast"),
                   "control broadcast (size)", timeout_s)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.coordinator
               else torch.empty(int(n[0]), dtype=torch.uint8))
        if buf.numel():
            self._wait(self.start(lambda: dist.broadcast(buf, group=self.group,
                                                         group_src=self.root,
                                                         async_op=True), "control broadcast"),
                       "control broadcast", timeout_s)
        return Message.from_json(bytes(buf.numpy())) if buf.numel() else None

    def post(self, message: Message) -> list[Any]:
        """Root: start broadcasting `message` without waiting for it (a last word, such
        as a failed push's outcome, must not delay the error); the works returned are
        kept until they complete."""
        data = message.to_json().encode()
        n = torch.tensor([len(data)], dtype=torch.int64)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        works = [self.start(lambda: dist.broadcast(n, group=self.group, group_src=self.root,
                                                   async_op=True), "control broadcast")]
        if buf.numel():
            works.append(self.start(lambda: dist.broadcast(buf, group=self.group,
                                                            group_src=self.root,
                                                            async_op=True), "control broadcast"))
        return [*works, n, buf]

    def gather(self, answer: Answer) -> list[Answer]:
        """Every rank's `answer`, in rank order, on every rank (any size: two
        collectives)."""
        data = answer.to_json().encode()
        n = torch.tensor([len(data)], dtype=torch.int64)
        ns = torch.zeros(self.size, dtype=torch.int64)
        self._wait(self.start(lambda: dist.all_gather_into_tensor(
            ns, n, group=self.group, async_op=True), "control gather"), "control gather (sizes)")
        width = int(ns.max())
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = torch.zeros(width * self.size, dtype=torch.uint8)
        self._wait(self.start(lambda: dist.all_gather_into_tensor(
            out, mine, group=self.group, async_op=True), "control gather"), "control gather")
        return [_answer(bytes(out[i * width: i * width + int(ns[i])].numpy()))
                for i in range(self.size)]

    def gather_short(self, answer: Answer) -> ShortGather:
        """Start gathering every rank's short `answer` (one collective, at most
        `SHORT_BYTES` of JSON: an answer, not data); `result()` waits for it. Starting it
        before a long local step keeps every rank's collectives in the same order."""
        data = answer.to_json().encode()
        if len(data) > SHORT_BYTES:
            data = Answer(ok=False, error=str(answer)[: SHORT_BYTES // 2]).to_json().encode()
        mine = torch.zeros(SHORT_BYTES + 8, dtype=torch.uint8)
        mine[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        mine[8: 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = torch.zeros((SHORT_BYTES + 8) * self.size, dtype=torch.uint8)
        work = self.start(lambda: dist.all_gather_into_tensor(out, mine, group=self.group,
                                                              async_op=True), "control answer")
        return ShortGather(self, work, out)


def _answer(raw: bytes) -> Answer:
    message = Message.from_json(raw)
    if not isinstance(message, Answer):
        raise MalformedMessage(f"expected an answer, got a {message.op!r} message")
    return message


class ShortGather:
    """A started `gather_short`."""

    def __init__(self, ranks: TrainerRanks, work: Any, out: torch.Tensor) -> None:
        self.ranks, self.work, self.out = ranks, work, out
        #: completes when the collective does; its callbacks run after `done()` is true
        #: (`Work.is_completed()` can still say False inside them: a waiter woken by a
        #: callback would then sleep until its timeout)
        self.future = work.get_future()

    def done(self) -> bool:
        return bool(self.future.done())

    def result(self, timeout_s: float | None = None) -> list[Answer]:
        self.ranks._wait(self.work, "control answer", timeout_s)
        w = SHORT_BYTES + 8
        answers = []
        for i in range(self.ranks.size):
            row = self.out[i * w: (i + 1) * w]
            n = int(row[:8].view(torch.int64)[0])
            answers.append(_answer(bytes(row[8: 8 + n].numpy())))
        return answers
