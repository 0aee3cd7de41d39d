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
- `end` and `bye` (coordinator: `WeightSync.push` / `close`): the outcome, and the end;
- `reuse` (coordinator: `ask_reuse`): plan once, push many (`core/layout.py`). After a
  successful push planned under a layout id, every rank keeps its own part of the plan
  (`Kept`: its adapter's layout key and plan, its owners, the manifest); a later push
  asks each rank whether its part still holds (its model's layout key is the kept one,
  its adapter takes the kept plan, its sender is intact), and where every rank says so,
  `send` carries only the reference to the layout (`core/layout.reference`), which each
  rank rebuilds from the manifest it kept. Any rank that says no (or a `plan`, or a
  failed push) drops the layout on every rank: the push plans in full.

`Follower` is the other ranks' side: it answers each command until the one that ends
the call (`end` for a push, `bye` for `close`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from enginehooks.control.shard_schedule import shard_source
from enginehooks.core.dtypes import dtype_name, torch_dtype
from enginehooks.core.errors import ConfigError, TransportError
from enginehooks.core.layout import layout_of, parse_reference, reference, with_version
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
    Reuse,
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
def ask_plans(ranks: TrainerRanks, adapter: TrainerAdapter,
              timeout_s: float | None = None) -> list[list[TensorSpec]]:
    """Coordinator: every rank's tensors (its `adapter.specs()`), in rank order, each
    rank's adapter told the coordinator's wire dtypes. `timeout_s` bounds the wait for
    the ranks to take the command (None: the channel's): after a failed push a rank may
    still be winding its own send down, within its own timeout."""
    ranks.broadcast(Plan(dtype_name(adapter.dtype) if adapter.dtype else None,
                         {n: dtype_name(d) if d is not None else None
                          for n, d in adapter.dtypes.items()}), timeout_s)
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


def ask_reuse(sender: SenderSet, layout: str) -> tuple[list[str], bool]:
    """Coordinator: ask every other rank whether its part of prepared layout `layout`
    still holds (`Reuse`); (each refusing rank's reason, whether one said its sender's
    group is gone). No refusal: every rank armed the layout for the next `Send`, and
    `sender` sends the reference."""
    answers = sender.command(Reuse(layout)).result(sender.timeout_s)
    refused = [f"trainer rank {j}: {a.error}" for j, a in enumerate(answers) if j and not a.ok]
    sender.held = None if refused else layout
    return refused, any(a.broken for a in answers[1:])


class SenderSet(Sender):
    """Trainer rank 0's sender while every rank of `ranks` sends its part: `own` (this
    rank's sender, from the transport) plus the other ranks' senders, which it opens,
    connects, drives and closes through commands."""

    def __init__(self, own: Sender, ranks: TrainerRanks, timeout_s: float) -> None:
        self.own, self.ranks, self.timeout_s = own, ranks, float(timeout_s)
        self._lock = threading.Lock()
        self._closed = False
        self._pending: list[ShortGather] = []
        #: the prepared layout every other rank armed (`ask_reuse`): the next `send` of a
        #: manifest planned under it sends the reference, once
        self.held: str | None = None
        #: whether the last `send` told the other ranks to send (their streams started)
        self.started = False
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
        held, self.held = self.held, None
        text = (reference(held, manifest.weight_version)
                if held is not None and layout_of(manifest) == held else manifest.to_json())
        self.started = False
        with self._lock:
            g = self.command(Send(text))
            self.started = True
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
@dataclass
class Kept:
    """A rank's own part of a prepared layout (module docstring)."""

    #: the layout id (the manifest's `meta["layout"]`)
    id: str
    #: its adapter's `layout_key()` when it planned
    key: str
    #: the adapter that planned it (kept alive: a later adapter adopts its plan)
    adapter: TrainerAdapter
    specs: list[TensorSpec]
    #: the whole manifest it sent its part of (any weight version)
    manifest: Manifest
    #: who sends each tensor (`owners_of`)
    owners: dict[str, int]
    #: the wire dtypes the coordinator's `Plan` gave
    dtype: Any
    dtypes: dict[str, Any]


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
        #: this rank's part of the prepared layout (after a successful planned push)
        self.kept: Kept | None = None
        #: this push's part of a layout, kept once the push ends well
        self._planned: Kept | None = None
        #: what this push's `_plan` found (layout key, specs, wire dtypes)
        self._plan_of: tuple[str | None, list[TensorSpec], Any, dict[str, Any]] | None = None
        #: the layout this push armed (`Reuse` answered ok): a `Send` may name it
        self._armed: Kept | None = None

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
                planned, self._planned, self._armed = self._planned, None, None
                self._plan_of = None
                if isinstance(cmd, End):
                    # the layout outlives only a push that ended well everywhere
                    if not cmd.ok or failed is not None:
                        self.kept = None
                    elif planned is not None:
                        self.kept = planned
                if isinstance(cmd, End) and not cmd.ok:
                    raise PushAborted(f"trainer rank {rank}: the push failed: {cmd.error}",
                                      str(cmd.error))
                if failed is not None:
                    raise TransportError(failed)
                if isinstance(cmd, (until, Bye)):
                    return stats
                continue
            if isinstance(cmd, Reuse):
                try:
                    answer = self._reuse(model, cmd)
                except Exception as e:
                    answer = Answer(ok=False, error=f"{type(e).__name__}: {e}"[:4000])
                if not answer.ok:
                    self.kept = None  # the coordinator plans this push in full
                ranks.gather_short(answer).result(self.timeout_s)
                continue
            if isinstance(cmd, Plan):
                self.kept = self._armed = None  # a new plan: the old layout is gone
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
        adapter = self._adapter(model, dtype, dtypes)
        self.adapter = adapter
        key = adapter.layout_key()  # before the plan, which shares its read of the model
        specs = adapter.specs()
        self._plan_of = (key, list(specs), dtype, dtypes)
        return specs

    @staticmethod
    def _adapter(model: Any, dtype: Any, dtypes: dict[str, Any]) -> TrainerAdapter:
        if isinstance(model, TrainerAdapter):
            if model.dtype is None and not model.dtypes:
                model.dtype, model.dtypes = dtype, dtypes
            return model
        return adapter_for(model, dtype=dtype, dtypes=dtypes)

    def _reuse(self, model: Any, cmd: Reuse) -> Answer:
        """Whether this rank's part of layout `cmd.layout` still holds; if so, arm it: the
        push's adapter takes the kept plan and owners (nothing is planned or gathered)."""
        kept = self.kept
        if kept is None or kept.id != cmd.layout:
            return Answer(ok=False, error=f"holds no layout {cmd.layout!r}")
        if self.sender is None or self.sender.broken:
            return Answer(ok=False, error="its sender's group is closed or broken",
                          broken=True)
        adapter = self._adapter(model, kept.dtype, dict(kept.dtypes))
        key = adapter.layout_key()
        if key is None or key != kept.key:
            return Answer(ok=False, error="its model's layout changed (names, dtypes or shapes)")
        if not adapter.reuse_plan(kept.adapter, kept.specs):
            return Answer(ok=False, error="its adapter cannot take the kept plan")
        if SCHEDULE_KEY not in kept.manifest.meta:  # a schedule's senders send shards
            adapter.owners = dict(kept.owners)
        self.adapter, self._armed = adapter, kept
        return Answer()

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
            ref = parse_reference(cmd.manifest)
            if ref is not None:  # a prepared layout this rank armed (`_reuse`)
                armed = self._armed
                if armed is None or armed.id != ref[0]:
                    raise TransportError(f"a send on layout {ref[0]!r}, which this rank did "
                                         "not arm")
                manifest = with_version(armed.manifest, ref[1])
                if SCHEDULE_KEY in manifest.meta:
                    return self._send_shards(manifest)
                part = parts(manifest)[self.ranks.rank]
                names = {t.name for t in part.tensors}
                stats = self._here().send(part, only(self.adapter.stream(), names), Abort())
                return Answer(seconds=stats.seconds, bytes=part.total_bytes), stats
            manifest = Manifest.from_json(cmd.manifest)
            scheduled = SCHEDULE_KEY in manifest.meta
            # this rank gathers, converts and casts only its part (issue 37 item 5); a
            # schedule's senders send their own shards (no parts)
            owners = {} if scheduled else owners_of(manifest, self.ranks)
            if not scheduled:
                self.adapter.owners = owners
            lid, planned = layout_of(manifest), self._plan_of
            if lid is not None and planned is not None and planned[0] is not None:
                self._planned = Kept(lid, planned[0], self.adapter, planned[1], manifest,
                                     dict(owners), planned[2], planned[3])
            if scheduled:  # its own shards, along the schedule
                return self._send_shards(manifest)
            part = parts(manifest)[self.ranks.rank]
            names = {t.name for t in part.tensors}
            stats = self._here().send(part, only(self.adapter.stream(), names), Abort())
            return Answer(seconds=stats.seconds, bytes=part.total_bytes), stats
        if isinstance(cmd, Close):
            self._drop()
            return Answer(), stats
        op = getattr(cmd, "op", cmd)
        raise ConfigError(f"unknown command {op!r} from trainer rank 0")

    def _send_shards(self, manifest: Manifest) -> tuple[Answer, SendStats]:
        """This rank's own shards, along `manifest`'s schedule (no gather)."""
        adapter, rank, size = self.adapter, self.ranks.rank, self.ranks.size
        stats = self._here().send(manifest, ShardStream(
            adapter.stream,  # type: ignore[union-attr]
            lambda: shard_source(adapter, rank, size)), Abort())
        return Answer(seconds=stats.seconds, bytes=stats.bytes), stats

    def _drop(self) -> None:
        sender, self.sender = self.sender, None
        if sender is not None:
            self.close_sender(sender)

    def _here(self, connected: bool = True) -> Sender:
        if self.sender is None or (connected and self.sender.broken):
            raise TransportError(f"trainer rank {self.ranks.rank} has no open sender")
        return self.sender
