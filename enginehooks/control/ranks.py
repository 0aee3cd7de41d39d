"""`TrainerRanks`: the trainer ranks that send one update together, and the control
channel between them.

Rank 0 (the coordinator, which talks to the engines) tells the other ranks what to do
next; they answer. Messages are JSON text carried as byte tensors over a
`torch.distributed` group of the trainer (gloo, on the host: no pickle, whatever
`broadcast_object_list` would do). Every wait is bounded; after a failed or timed-out
collective the channel's state is unknown and it is `broken` for good: every later call
raises at once (a trainer that lost a rank restarts its process group anyway).
"""

from __future__ import annotations

import datetime as _dt
import json
from typing import Any

import torch
import torch.distributed as dist

from enginehooks.core.errors import TransportError

#: The size of one short answer (`gather_short`): errors are cut to fit.
SHORT_BYTES = 8192


class RanksBroken(TransportError):
    """The trainer ranks' control channel failed (a rank died, or did not answer)."""


class TrainerRanks:
    """Rank, size and control channel of the trainer ranks that send together.

    Args:
        group: the `torch.distributed` group of every sending rank (None: the default
            group); must support CPU tensors (gloo, or a gloo side group of an NCCL job).
        timeout_s: the longest one control exchange waits.
    """

    def __init__(self, group: Any = None, timeout_s: float = 120.0) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.timeout_s = float(timeout_s)
        self.broken: str | None = None

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    # -- collectives ------------------------------------------------------------------
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

    def broadcast(self, message: Any = None, timeout_s: float | None = None) -> Any:
        """Rank 0's `message` (JSON-able) on every rank."""
        n = torch.zeros(1, dtype=torch.int64)
        data = b""
        if self.coordinator:
            data = json.dumps(message).encode()
            n[0] = len(data)
        self._wait(self.start(lambda: dist.broadcast(n, group=self.group, group_src=0,
                                                     async_op=True), "control broadcast"),
                   "control broadcast (size)", timeout_s)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.coordinator
               else torch.empty(int(n[0]), dtype=torch.uint8))
        if buf.numel():
            self._wait(self.start(lambda: dist.broadcast(buf, group=self.group, group_src=0,
                                                         async_op=True), "control broadcast"),
                       "control broadcast", timeout_s)
        return json.loads(bytes(buf.numpy()).decode()) if buf.numel() else None

    def post(self, message: Any) -> list[Any]:
        """Rank 0: start broadcasting `message` without waiting for it (a last word,
        such as a failed push's outcome, must not delay the error); the works returned
        are kept until they complete."""
        data = json.dumps(message).encode()
        n = torch.tensor([len(data)], dtype=torch.int64)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        works = [self.start(lambda: dist.broadcast(n, group=self.group, group_src=0,
                                                   async_op=True), "control broadcast")]
        if buf.numel():
            works.append(self.start(lambda: dist.broadcast(buf, group=self.group, group_src=0,
                                                            async_op=True), "control broadcast"))
        return [*works, n, buf]

    def gather(self, message: Any) -> list[Any]:
        """Every rank's `message`, in rank order, on every rank (any size: two
        collectives)."""
        data = json.dumps(message).encode()
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
        return [json.loads(bytes(out[i * width: i * width + int(ns[i])].numpy()).decode())
                for i in range(self.size)]

    def gather_short(self, message: Any) -> ShortGather:
        """Start gathering every rank's short `message` (one collective, at most
        `SHORT_BYTES` of JSON: an answer, not data); `result()` waits for it. Starting it
        before a long local step keeps every rank's collectives in the same order."""
        data = json.dumps(message).encode()
        if len(data) > SHORT_BYTES:
            data = json.dumps({"ok": False, "error": str(message)[: SHORT_BYTES // 2]}).encode()
        mine = torch.zeros(SHORT_BYTES + 8, dtype=torch.uint8)
        mine[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        mine[8: 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = torch.zeros((SHORT_BYTES + 8) * self.size, dtype=torch.uint8)
        work = self.start(lambda: dist.all_gather_into_tensor(out, mine, group=self.group,
                                                              async_op=True), "control answer")
        return ShortGather(self, work, out)


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

    def result(self, timeout_s: float | None = None) -> list[Any]:
        self.ranks._wait(self.work, "control answer", timeout_s)
        w = SHORT_BYTES + 8
        answers = []
        for i in range(self.ranks.size):
            row = self.out[i * w: (i + 1) * w]
            n = int(row[:8].view(torch.int64)[0])
            answers.append(json.loads(bytes(row[8: 8 + n].numpy()).decode()))
        return answers
