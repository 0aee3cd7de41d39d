"""Several trainer ranks sending one update (`WeightSync(senders=...)`, `docs/scale.md`):
both halves of the command protocol between them, in one module.

One sender's link caps an update across nodes (a 1T-parameter model takes ~54 s through
one 400 Gb/s NIC). With k trainer ranks sending, each rank ships only its part, all at
once, each over its own broadcast group, under one manifest and one update id
(`core/senders.py`). Trainer rank 0 (the coordinator) is the `WeightSync` that talks to
the engines, through the same push routine as one sender; the other ranks follow its
typed commands (`trainer_side/channel.py`):

- `plan` (coordinator: `ask_plans`): every rank says which tensors it can stream; the
  coordinator plans one manifest (`core/manifest.plan(parts=...)`): ranks that each
  stream the whole model (FSDP ranks gathering in lockstep) get a balanced share, ranks
  that each own a part send that part; lockstep ranks get the send order written into
  the manifest (`with_send_order`);
- `open`, `connect`, `send`, `close` (coordinator: `SenderSet`, the `Sender` that the
  coordinator's `WeightSync` holds while several ranks send): each rank opens its own
  sender through the `update_group` hook, joins its group, sends its part;
- `end` and `bye` (coordinator: `WeightSync.push` / `close`): the outcome, and the end.

`Follower` is the other ranks' side: it answers each command until the one that ends
the call (`end` for a push, `bye` for `close`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from enginehooks.control.shard_schedule import shard_source
from enginehooks.core.dtypes import dtype_name, torch_dtype
from enginehooks.core.errors import ConfigError, TransportError
from enginehooks.core.manifest import Manifest, TensorSpec
from enginehooks.core.report import PushReport
from enginehooks.core.senders import ORDER_KEY, only, parts, send_order
from enginehooks.trainer_side.channel import (
    Answer,
    Bye,
    Close,
    Command,
    Connect,
    End,
    Open,
    Plan,
    RanksBroken,
    Send,
    ShortGather,
    TrainerRanks,
)
from enginehooks.trainer_side.choose import adapter_for
from enginehooks.trainer_side.contract import TrainerAdapter
from enginehooks.trainer_side.lockstep import PushAborted
from enginehooks.transports.base import Abort, Sender, SendStats, Stream
from enginehooks.transports.shard_direct import ShardStream
from enginehooks.wire.schedule import SCHEDULE_KEY

#: How long the coordinator waits for the other ranks' answer to a `close`.
CLOSE_WAIT_S = 5.0


# -- the coordinator ------------------------------------------------------------------------
def ask_plans(ranks: TrainerRanks, adapter: TrainerAdapter) -> list[list[TensorSpec]]:
    """Coordinator: every rank's tensors (its `adapter.specs()`), in rank order, each
    rank's adapter told the coordinator's wire dtypes."""
    ranks.broadcast(Plan(dtype_name(adapter.dtype) if adapter.dtype else None,
                         {n: dtype_name(d) if d is not None else None
                          for n, d in adapter.dtypes.items()}))
    mine = adapter.specs()
    answers = ranks.gather(Answer.of_specs(mine))
    bad = [f"trainer rank {j}: {a.error}" for j, a in enumerate(answers) if not a.ok]
    if bad:
        raise ConfigError("planning failed on " + "; ".join(bad))
    return [mine] + [a.tensor_specs(j) for j, a in enumerate(answers) if j]


def with_send_order(manifest: Manifest, per_rank: list[list[TensorSpec]]) -> Manifest:
    """`manifest` with the order its buckets are sent in (`meta["order"]`), where every
    rank streams the same tensors (lockstep ranks, which the receivers must follow on
    NCCL: `transports/multisender.py`); else `manifest` itself."""
    mine = per_rank[0]
    if not all(list(p) == list(mine) for p in per_rank[1:]):
        return manifest
    order = send_order(manifest, [s.name for s in mine])
    if order is None:
        return manifest
    d = manifest.to_dict()
    d["meta"] = {**d["meta"], ORDER_KEY: order}
    return Manifest.from_dict(d)


def owners_of(manifest: Manifest, ranks: TrainerRanks) -> dict[str, int]:
    """Checkpoint name -> the global rank of the trainer rank that sends it: what each
    rank's adapter needs to produce only its own part (`TrainerAdapter.owners`)."""
    return {t.name: ranks.global_rank(j) for j, part in enumerate(parts(manifest))
            for t in part.tensors}


class SenderSet(Sender):
    """Trainer rank 0's sender while every rank of `ranks` sends its part: `own` (this
    rank's sender, from the transport) plus the other ranks' senders, which it opens,
    connects, drives and closes through commands."""

    def __init__(self, own: Sender, ranks: TrainerRanks, timeout_s: float) -> None:
        self.own, self.ranks, self.timeout_s = own, ranks, float(timeout_s)
        self._lock = threading.Lock()
        self._closed = False
        self._pending: list[ShortGather] = []
        try:
            answers = self.command(Open()).result()
            self.endpoints = [own.endpoint()] + [a.endpoint or {} for a in self._ok(
                answers, "open its sender")[1:]]
        except BaseException:
            own.close()
            raise

    # -- the commands ---------------------------------------------------------------------
    def command(self, cmd: Command, timeout_s: float | None = None) -> ShortGather:
        """Send `cmd` to every other rank and start gathering their answers."""
        self._settle()
        self.ranks.broadcast(cmd, timeout_s)
        g = self.ranks.gather_short(Answer())
        self._pending.append(g)
        return g

    def _settle(self) -> None:
        """Wait for answers still outstanding (a command abandoned by a failed push):
        every rank's collectives must come in the same order."""
        while self._pending:
            g = self._pending.pop(0)
            if not g.done():
                g.result(self.timeout_s)

    @staticmethod
    def _ok(answers: list[Answer], what: str) -> list[Answer]:
        bad = [(j, a) for j, a in enumerate(answers) if j and not a.ok]
        if bad:
            raise TransportError("; ".join(f"trainer rank {j} could not {what}: {a.error}"
                                           for j, a in bad))
        return answers

    # -- Sender ---------------------------------------------------------------------------
    def endpoint(self) -> dict[str, Any]:
        own = self.own.endpoint()
        return {**own, "group": f"multi-{own['group']}", "senders": self.endpoints}

    def connect(self, world_size: int) -> None:
        with self._lock:
            if self._closed:
                raise TransportError("the sender group was closed before it connected")
            g = self.command(Connect(world_size))
        self.own.connect(world_size)
        self._ok(g.result(self.timeout_s), "join its broadcast group")

    def send(self, manifest: Manifest, stream: Stream, abort: Abort) -> SendStats:
        # a shard-direct schedule (`control/shard_schedule.py`) is every rank's whole
        # plan: each sends its own shards along it, from the whole manifest
        scheduled = SCHEDULE_KEY in manifest.meta
        mine = [manifest] * len(self.endpoints) if scheduled else parts(manifest)
        if len(mine) != len(self.endpoints):
            raise TransportError(f"the manifest has {len(mine)} senders; the group has "
                                 f"{len(self.endpoints)}")
        t0 = time.perf_counter()
        with self._lock:
            g = self.command(Send(manifest.to_json()))
        names = {t.name for t in mine[0].tensors}
        stats = self.own.send(mine[0], stream if scheduled else only(stream, names), abort)
        g.future.add_done_callback(lambda _f: abort.poke())
        if not abort.wait_for(g.done, self.timeout_s):
            raise TransportError(f"trainer ranks 1..{self.ranks.size - 1} did not finish "
                                 f"sending within {self.timeout_s}s")
        answers = self._ok(g.result(self.timeout_s), "send its part")
        if scheduled:  # the schedule's bytes, every rank's (the model's once, or so)
            stats.extra["schedule"] = [stats.extra.get("schedule")] + [
                {"rank": j, "bytes": a.bytes} for j, a in enumerate(answers) if j]
            stats.bytes = stats.bytes + sum(a.bytes or 0 for a in answers[1:])
        else:
            stats.bytes = manifest.total_bytes
        stats.buckets = len(manifest.buckets)
        stats.seconds = time.perf_counter() - t0
        stats.extra["senders"] = [{"rank": 0, "seconds": stats.seconds}] + [
            {"rank": j, "seconds": a.seconds, "bytes": a.bytes}
            for j, a in enumerate(answers) if j]
        return stats

    @property
    def broken(self) -> bool:
        return self._closed or self.own.broken or self.ranks.broken is not None

    def close(self) -> None:
        """Close this rank's sender and tell the others to close theirs; their answer is
        not waited for here (it is before the next command), so a failed push is
        reported at once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.own.close()
            # With an answer still outstanding (a failed push), say nothing: the other
            # ranks close their senders when the next group opens.
            if self.ranks.broken is None and all(g.done() for g in self._pending):
                with contextlib.suppress(RanksBroken):
                    self.command(Close(), timeout_s=CLOSE_WAIT_S)


# -- the other ranks ------------------------------------------------------------------------
class Follower:
    """A sending trainer rank other than the coordinator: answers its commands.

    Args:
        ranks: the channel (this rank is not its root).
        open_sender: opens this rank's sender (the transport's, through `update_group`).
        close_sender: closes it (through `update_group`).
        timeout_s: the push's timeout; a rank waits for its next command at most
            `6 x timeout_s + 60` s (the phases between two commands).
        transport: the transport's name, for reports.
    """

    def __init__(self, ranks: TrainerRanks, open_sender: Callable[[], Sender],
                 close_sender: Callable[[Sender], None], timeout_s: float,
                 transport: str) -> None:
        self.ranks = ranks
        self.open_sender, self.close_sender = open_sender, close_sender
        self.timeout_s = float(timeout_s)
        self.transport = transport
        self.sender: Sender | None = None
        self.adapter: TrainerAdapter | None = None

    def follow(self, model: Any, version: int | str) -> PushReport:
        """One push on this rank: a report of its own part (bytes, buckets); raises
        `PushAborted` when the push failed anywhere."""
        report = PushReport(version=version, transport=self.transport)
        stats = self.serve(model, until=End)
        if stats is not None:
            report.bytes, report.buckets = stats.bytes, stats.buckets
        return report

    def close(self) -> None:
        """`close()` on this rank: serve until the coordinator's `bye`, then close."""
        try:
            self.serve(None, until=Bye)
        finally:
            self._drop()

    def serve(self, model: Any, until: type[End] | type[Bye]) -> SendStats | None:
        """Answer the coordinator's commands until `until` (or `bye`)."""
        ranks, rank = self.ranks, self.ranks.rank
        long_wait = 6 * self.timeout_s + 60.0
        failed: str | None = None
        stats: SendStats | None = None
        while True:
            cmd = ranks.broadcast(None, timeout_s=self.timeout_s if failed else long_wait)
            if isinstance(cmd, (End, Bye)):
                if isinstance(cmd, End) and not cmd.ok:
                    raise PushAborted(f"trainer rank {rank}: the push failed: {cmd.error}",
                                      str(cmd.error))
                if failed is not None:
                    raise TransportError(failed)
                if isinstance(cmd, (until, Bye)):
                    return stats
                continue
            if isinstance(cmd, Plan):
                try:
                    answer = Answer.of_specs(self._plan(model, cmd))
                except Exception as e:
                    answer = Answer(ok=False, error=f"{type(e).__name__}: {e}")
                ranks.gather(answer)
                continue
            try:
                answer, stats = self._handle(cmd, stats)
            except Exception as e:
                answer = Answer(ok=False, error=f"{type(e).__name__}: {e}"[:4000])
                if isinstance(cmd, Send):
                    failed = f"trainer rank {rank}: sending its part failed: {answer.error}"
            ranks.gather_short(answer).result(self.timeout_s)

    def _plan(self, model: Any, cmd: Plan) -> list[TensorSpec]:
        dtype = torch_dtype(cmd.dtype) if cmd.dtype else None
        dtypes = {n: torch_dtype(d) if d is not None else None for n, d in cmd.dtypes.items()}
        if isinstance(model, TrainerAdapter):
            adapter = model
            if adapter.dtype is None and not adapter.dtypes:
                adapter.dtype, adapter.dtypes = dtype, dtypes
        else:
            adapter = adapter_for(model, dtype=dtype, dtypes=dtypes)
        self.adapter = adapter
        return adapter.specs()

    def _handle(self, cmd: Any, stats: SendStats | None) -> tuple[Answer, SendStats | None]:
        if isinstance(cmd, Open):
            self._drop()
            self.sender = self.open_sender()
            return Answer(endpoint=self.sender.endpoint()), stats
        if isinstance(cmd, Connect):
            self._here(connected=False).connect(int(cmd.world))
            return Answer(), stats
        if isinstance(cmd, Send):
            if self.adapter is None:
                raise TransportError("send before plan")
            manifest = Manifest.from_json(cmd.manifest)
            if SCHEDULE_KEY in manifest.meta:  # its own shards, along the schedule
                adapter, rank, size = self.adapter, self.ranks.rank, self.ranks.size
                stats = self._here().send(manifest, ShardStream(
                    adapter.stream, lambda: shard_source(adapter, rank, size)), Abort())
                return Answer(seconds=stats.seconds, bytes=stats.bytes), stats
            part = parts(manifest)[self.ranks.rank]
            names = {t.name for t in part.tensors}
            # this rank gathers, converts and casts only its part (issue 37 item 5)
            self.adapter.owners = owners_of(manifest, self.ranks)
            stats = self._here().send(part, only(self.adapter.stream(), names), Abort())
            return Answer(seconds=stats.seconds, bytes=part.total_bytes), stats
        if isinstance(cmd, Close):
            self._drop()
            return Answer(), stats
        op = getattr(cmd, "op", cmd)
        raise ConfigError(f"unknown command {op!r} from trainer rank 0")

    def _drop(self) -> None:
        sender, self.sender = self.sender, None
        if sender is not None:
            self.close_sender(sender)

    def _here(self, connected: bool = True) -> Sender:
        if self.sender is None or (connected and self.sender.broken):
            raise TransportError(f"trainer rank {self.ranks.rank} has no open sender")
        return self.sender
