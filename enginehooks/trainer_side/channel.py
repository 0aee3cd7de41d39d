"""The one channel between trainer ranks, and the typed messages it carries.

Trainer ranks talk to each other for two reasons, over one channel:

- **lockstep flags** (`trainer_side/lockstep.py`): before each tensor of a sharded
  stream the sender rank says `Go` (with the tensor index, the stream's fingerprint and
  the wire dtype) or `Stop` (with the reason), in one fixed-size frame (`flag`, one
  collective per tensor, on the group's own device), so that no rank enters a gather
  that its peers will never enter;
- **commands of several senders** (`control/senders.py`): trainer rank 0, which talks
  to the engines, tells the other sending ranks what to do next (`Plan`, `Reuse`, `Open`,
  `Connect`, `Send`, `Close`, `End`, `Bye`) and gathers their `Answer`s.

Every message is a small dataclass of `wire/ranks.py` (the wire builds and parses every
message; plain JSON text with an `"op"` naming its class; never pickle, which
`broadcast_object_list` would use); a message that does not parse into one of them is
refused (`MalformedMessage`). Messages travel as byte tensors over a `torch.distributed`
group of the trainer. Every wait of a command is bounded; after a failed or timed-out
command exchange the channel's state is unknown and it is `broken` for good: every later
call raises at once (a trainer that lost a rank restarts its process group anyway). A
failed flag is the lockstep's to report (`LockstepError`).
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

import torch
import torch.distributed as dist

from enginehooks.core.errors import TransportError
from enginehooks.wire.ranks import FLAG_BYTES as FLAG_BYTES
from enginehooks.wire.ranks import Answer as Answer
from enginehooks.wire.ranks import Bye as Bye
from enginehooks.wire.ranks import Close as Close
from enginehooks.wire.ranks import Command as Command
from enginehooks.wire.ranks import Connect as Connect
from enginehooks.wire.ranks import End as End
from enginehooks.wire.ranks import Go as Go
from enginehooks.wire.ranks import MalformedMessage as MalformedMessage
from enginehooks.wire.ranks import Message as Message
from enginehooks.wire.ranks import Open as Open
from enginehooks.wire.ranks import Plan as Plan
from enginehooks.wire.ranks import Reuse as Reuse
from enginehooks.wire.ranks import Send as Send
from enginehooks.wire.ranks import Stop as Stop
from enginehooks.wire.ranks import frame as frame
from enginehooks.wire.ranks import unframe as unframe

#: The size of one short answer (`gather_short`): errors are cut to fit.
SHORT_BYTES = 8192


class RanksBroken(TransportError):
    """The trainer ranks' control channel failed (a rank died, or did not answer)."""


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
