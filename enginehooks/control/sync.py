"""`WeightSync`: pushes one weight version from a trainer into every registered replica.

The coordinator lives on the trainer's sender rank. It never blocks on an engine
without a deadline: each replica call runs on its own thread as a future, the sender
waits on its collectives and on those futures together, and the first failure
anywhere ends the push with an error naming the replica, within the timeout.

One push routine serves one sender and several (`senders=`: every trainer rank sends
its part of the update over a group of its own, `docs/scale.md`): the coordinator (the
only sender, or trainer rank 0) runs the phases below; with several senders its plan
asks every rank for its tensors and its sender is a `SenderSet` that drives the other
ranks' senders (`control/senders.py`), while `push` on the other ranks answers its
commands (`Follower`).

Phases of a push (each timed through the `run_phase` hook):
  plan      names/dtypes/shapes -> manifest (no tensor is produced)
  group     form the transport group if membership changed
  check     every replica validates the manifest against its model: before data moves
  transfer  sender streams buckets while every replica receives and applies
  finish    replicas flush prefix caches and resume

Plan once, push many (`core/layout.py`): a push whose model and replicas are laid out as
the last successful one's (the same layout key, the same replicas, the group intact)
skips plan, info, group and check, and sends each replica one signed `receive` naming
the layout; a replica that no longer holds it answers `LayoutUnknown` and the push falls
back to the full path. `PushReport.layout` says which path ran, each replica's `rpcs`
how many calls it got. With several senders every trainer rank keeps its own part of
the plan under the same id, and a later push first asks each rank whether its part
still holds (`control/senders.ask_reuse`: one short command, no plan); a rank whose
model changed or whose sender's group broke says no, and the push plans in full.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass
from typing import Any

import torch

from enginehooks import wire
from enginehooks.control._futures import spawn
from enginehooks.control.adapters import AdapterReport, AdapterVersions, adapter_upload
from enginehooks.control.handles import EngineHandle
from enginehooks.control.senders import (
    Follower,
    SenderSet,
    ask_plans,
    ask_reuse,
    owners_of,
    with_send_order,
)
from enginehooks.control.shard_schedule import (
    SCHEDULE_OFF_KEY,
    ShardPlanner,
    matching,
    shard_source,
)
from enginehooks.core.auth import AuthError, load_secret
from enginehooks.core.checksums import check_name
from enginehooks.core.deadline import Deadline
from enginehooks.core.dtypes import torch_dtype
from enginehooks.core.errors import (
    ChecksumError,
    ConfigError,
    EngineHooksError,
    LayoutUnknown,
    ManifestError,
    PeerLost,
    PushTimeout,
    ReplicaError,
    ReplicaUnreachable,
    TransferStalled,
    TransportError,
)
from enginehooks.core.keep import KEEP_KEY
from enginehooks.core.layout import LAYOUT_KEY, layout_key, reference, with_version
from enginehooks.core.manifest import Manifest, TensorSpec, plan
from enginehooks.core.report import PushReport, ReplicaResult
from enginehooks.core.senders import decide_parts
from enginehooks.plugins import get_plugin_manager, get_transport, transports
from enginehooks.trainer_side.channel import Bye, End, RanksBroken, TrainerRanks
from enginehooks.trainer_side.choose import adapter_for
from enginehooks.trainer_side.contract import TrainerAdapter
from enginehooks.trainer_side.keep import leave_out, module_names
from enginehooks.trainer_side.lockstep import LockstepAdapter
from enginehooks.transports.base import Abort, JoinSender, LeaveSender, Sender, Stream
from enginehooks.transports.shard_direct import ShardStream
from enginehooks.wire.schedule import NEEDS_DIGEST_KEY, NEEDS_KEY, SCHEDULE_KEY

DEFAULT_BUCKET_BYTES = 256 << 20
#: How long, after a failure that another party caused, the replicas get to report their
#: own errors (bounded by `timeout_s` too).
GRACE_S = 5.0

# Which replica caused a failed phase: each replica's outcome, ranked (lower first), by
# the error's class only (the transports raise `PeerLost` / `TransferStalled` where torch
# reports a lost peer or a wait that ran out: `transports.base.data_plane_error`).
#: the replica's own failure: a refused manifest, a bad checksum, an engine exception
OWN = 0
#: no answer: its call is still pending, timed out, or its host cannot be reached
NO_ANSWER = 1
#: its data plane timed out waiting for bytes (a stalled peer stalls every receiver)
STALLED = 2
#: a consequence of another party's failure: the sender aborted the update, closed or
#: reset the connection, after its own failure or another receiver's
CONSEQUENCE = 3


#: Errors that are a replica's own verdict on the update: they reach the trainer as the
#: same class on every path (`_failure`).
VERDICTS: tuple[type[EngineHooksError], ...] = (ChecksumError, AuthError, ManifestError,
                                                ConfigError)


def blame(error: BaseException | None) -> int:
    """How directly one replica's outcome of a failed phase points at that replica as
    its cause (`OWN` .. `CONSEQUENCE`); `None` is a call that has not answered. A
    healthy replica that hears of another party's failure first (its connection to the
    sender closed) must not be named instead of the replica that disappeared. Ranked by
    class, never by the message's words (a message is the sender's, and can be anyone's)."""
    if error is None or isinstance(error, (PushTimeout, ReplicaUnreachable)):
        return NO_ANSWER
    if isinstance(error, PeerLost):
        return CONSEQUENCE
    if isinstance(error, TransferStalled):
        return STALLED
    return OWN


def _has_followers(adapter: TrainerAdapter) -> bool:
    """Whether other trainer ranks iterate `adapter`'s stream in lockstep with this one."""
    return isinstance(adapter, LockstepAdapter) and not adapter.lockstep.alone


def require_several_senders(transport: str) -> None:
    """Refuse a transport that cannot split an update over several senders (one copy per
    replica, or files: no groups to split it over)."""
    able = tuple(n for n, t in transports().items() if t.several_senders)
    if not get_transport(transport).several_senders:
        raise ConfigError(f"several senders run over {able}, not {transport!r} "
                          "(docs/scale.md)")


@dataclass
class PreparedLayout:
    """What the first push to a set of replicas established (`core/layout.py`)."""

    #: the id the workers keep the manifest under
    id: str
    #: the adapter's layout key and the push options, digested
    key: str
    #: the manifest they checked and took (any weight version)
    manifest: Manifest
    #: the adapter that planned it (kept alive: a later adapter adopts its plan)
    adapter: TrainerAdapter
    specs: list[TensorSpec]
    #: the replicas it was established with, in order
    replicas: list[EngineHandle]
    #: the wire dtypes the replicas asked for then (`wire_dtypes`)
    wire: tuple[torch.dtype | None, dict[str, torch.dtype | None]]
    #: several senders: who sends each tensor (`owners_of`); each rank keeps its own part
    owners: dict[str, int] | None = None
    #: a shard-direct schedule's layout: each engine worker's needs digest
    #: (`wire/schedule.NEEDS_DIGEST_KEY`) it was computed from, per replica
    needs: list[list[str | None]] | None = None


class WeightSync:
    """Coordinates pushes from this (sender) trainer rank to engine replicas.

    Args:
        transport: a registered transport name ("gloo", "nccl", "disk", plugins').
        host, port: where the rendezvous store listens (loopback by default; port 0
            picks a free one). Engines must reach it.
        bucket_bytes: size of one bucket; two or three buckets per side bound the extra
            memory. Default: the transport's `default_bucket_bytes` (chosen by measurement:
            1 GiB for nccl and cuda_ipc, 256 MiB for the others).
        timeout_s: the longest any one phase may take; every wait uses it.
        checksum: bucket digest the receivers verify: "auto" (the transport's default:
            xxh3 for host buffers, sum64 computed on the GPU for nccl/cuda_ipc), "xxh3",
            "crc32", "sum64", or None.
        dtype: the dtype to send; None asks the replicas (they must agree).
        device: where the sender's buffers live (the trainer's GPU for nccl).
        pause: pause generation around the transfer (servers with in-flight requests).
        transport_options: passed to the transport's sender (disk: {"root": folder}).
        secret: the shared secret that signs every control message and bucket
            (`core/auth.py`); None reads `ENGINEHOOKS_SECRET` / `ENGINEHOOKS_SECRET_FILE`.
            Engines with a secret refuse unsigned or wrongly signed updates.
        on_torn: what the engines do while an update failed after data moved: "refuse"
            generation (the engines' default) or "serve" and mark the answers; None
            leaves each engine's own setting.
        wake_up: colocated RL, where the engines sleep while training runs (vLLM
            `sleep`, SGLang `release_memory_occupation`): wake their weights after the
            check, update them, flush, then wake the KV cache, which lets them schedule
            again. `pause` is not used then (a sleeping engine does not schedule); an
            engine that says it is awake is refused before anything moves.
        verify: every engine worker verifies this push against a fresh load of the same
            tensors through its own loader (`engine/verify.py`), besides the first update of
            its process, which it verifies anyway; a mismatch it cannot repair fails the
            push, naming the tensors. Costs one model's memory on each engine while it runs.
        senders: the trainer ranks that send this update together (`docs/scale.md`): the
            channel between them (`TrainerRanks` over a gloo group of their own), None for
            one sender. Build the same `WeightSync` on every rank, each with its own
            `host`; register the replicas on rank 0 (the coordinator); call `push` and
            `close` on every rank at the same point of the loop. gloo and nccl only.
    """

    def __init__(
        self,
        transport: str = "gloo",
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        bucket_bytes: int | None = None,
        timeout_s: float = 120.0,
        checksum: str | None = "auto",
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        pause: bool = False,
        transport_options: dict[str, Any] | None = None,
        secret: bytes | str | None = None,
        on_torn: str | None = None,
        wake_up: bool = False,
        verify: bool = False,
        senders: TrainerRanks | None = None,
    ) -> None:
        if on_torn not in (None, "refuse", "serve"):
            raise ConfigError(f"on_torn={on_torn!r}: 'refuse', 'serve' or None")
        self.transport_name = transport
        self.transport = get_transport(transport)
        if senders is not None:
            require_several_senders(transport)
        if checksum == "auto":
            checksum = self.transport.default_checksum
        check_name(checksum)
        self.host, self.port = host, port
        self.bucket_bytes = int(bucket_bytes if bucket_bytes is not None
                                else self.transport.default_bucket_bytes)
        self.timeout_s = float(timeout_s)
        self.checksum = checksum
        self.dtype = torch_dtype(dtype) if isinstance(dtype, str) else dtype
        self.device = device
        self.pause = pause
        self.transport_options = dict(transport_options or {})
        self.secret = secret.encode() if isinstance(secret, str) else (secret or load_secret())
        self.on_torn = on_torn
        self.wake_up = wake_up
        self.verify = bool(verify)
        self._replicas: list[EngineHandle] = []
        self._sender: Sender | None = None
        self._members: list[EngineHandle] = []
        self._worker_counts: dict[int, int] = {}
        #: each replica's workers' ids (`info`'s `instance`): the audience of its tokens
        self._audience: dict[int, list[str]] = {}
        self._lock = threading.Lock()  # one push at a time
        self._pm = get_plugin_manager()
        #: the trainer ranks sending together (None: this rank alone)
        self.senders = senders
        #: the other ranks' side of several senders
        self._follower = (Follower(senders, self._open_sender, self._leave_sender,
                                   self.timeout_s, transport)
                          if senders is not None and not senders.coordinator else None)
        self._last_word: list[Any] = []  # the coordinator's `end`, kept until it completes
        self._adapters = AdapterVersions()
        #: the layout the last successful push established (None: plan the next one)
        self._layout: PreparedLayout | None = None
        #: the replicas' wire dtypes as last asked (`wire_dtypes`)
        self._wire: tuple[torch.dtype | None, dict[str, torch.dtype | None]] | None = None
        #: calls made to each replica (by id) in the push under way (`PushReport.rpcs`)
        self._rpcs: dict[int, int] = {}
        self._rpcs_lock = threading.Lock()
        #: several senders: whether this push's transfer told the other ranks to send
        self._ranks_sent = False
        #: the receive calls of the last transfer (a fallback waits for them to end)
        self._receives: list[Future[Any]] = []
        #: the shard-direct schedule, kept per layout (`Transport.schedules` only)
        self._planner: ShardPlanner | None = None
        #: each worker's needs (by its id) under their digest: asked once per layout
        self._needs_held: dict[str, tuple[str, Any]] = {}
        #: the needs digests of the workers the last schedule was computed for
        self._schedule_needs: list[list[str | None]] | None = None
        #: how many times the workers' needs were asked (`InfoRequest(needs=True)`)
        self.needs_asked = 0

    # -- membership ---------------------------------------------------------------------
    def add_replica(self, handle: EngineHandle) -> None:
        """Register a replica; the group is rebuilt at the next push."""
        if self._follower is not None:
            raise ConfigError(f"trainer rank {self._follower.ranks.rank}: register replicas "
                              "on rank 0, the coordinator")
        with self._lock:
            if handle not in self._replicas:
                self._replicas.append(handle)
            # Handles that sign the engine's own control routes (VLLMServer) sign with
            # this trainer's secret unless they were given one.
            adopt = getattr(handle, "adopt_secret", None)
            if self.secret and callable(adopt):
                adopt(self.secret)

    def remove_replica(self, handle: EngineHandle) -> None:
        with self._lock:
            if handle in self._replicas:
                self._replicas.remove(handle)

    @property
    def replicas(self) -> list[EngineHandle]:
        return list(self._replicas)

    def connect(self) -> None:
        """Form the transport group with the registered replicas now, instead of at
        the next push (which forms it when needed): for callers whose protocol has a
        rendezvous step, like vLLM's trainer-side `trainer_init`."""
        if self.senders is not None:
            raise ConfigError("with several senders the group forms inside push(), which every "
                              "rank calls")
        with self._lock:
            if not self._replicas:
                raise EngineHooksError("connect() with no replica registered (add_replica first)")
            self._ensure_group()

    # -- the push -------------------------------------------------------------------------
    def push(self, model: Any, version: int | str, *, keep: Sequence[str] = ()) -> PushReport:
        """Push `model`'s weights as `version` to every replica; raise on any failure.

        `model` is anything a registered trainer adapter accepts (an `nn.Module`, an HF
        model), or an adapter itself. The report is returned on success and attached
        to the raised error (`error.report`) on failure.

        `keep`: modules left out of the update whole (checkpoint name prefixes such as
        "model.vision_tower" for a frozen tower): the manifest lists them, the engines
        keep what they hold for them, and every module that is sent must be sent whole
        (`trainer_side.keep`).

        With several senders, call it on every rank: rank 0 returns the report; the
        other ranks return a report of their own part (bytes, buckets), and raise when
        the push failed anywhere.
        """
        keep = module_names(keep)
        if self.senders is None:
            return self._push_here(model, version, keep)
        if keep:
            raise ConfigError("push(keep=...) takes one sender for now; with several, "
                              "send the whole model")
        if self.device is None and self.transport_name == "nccl":
            # each rank's sender on its own GPU (the current device of the rank's
            # process), not on the coordinator's
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self._follower is not None:
            return self._follower.follow(model, version)
        try:
            report = self._push_here(model, version)
        except BaseException as e:
            self._tell(End(ok=False, error=f"{type(e).__name__}: {e}"[:4000]))
            raise
        self._tell(End(ok=True))
        return report

    def _tell(self, message: End | Bye) -> None:
        """Coordinator: the other ranks' last word of a push or of `close` (not waited
        for: it must not delay the error)."""
        if self.senders is not None and self.senders.broken is None:
            with contextlib.suppress(RanksBroken):
                self._last_word = self.senders.post(message)

    def _push_here(self, model: Any, version: int | str,
                   keep: tuple[str, ...] = ()) -> PushReport:
        with self._lock:
            if not self._replicas:
                raise EngineHooksError("push() with no replica registered (add_replica first)")
            report = PushReport(version=version, transport=self.transport_name)
            report.replicas = [ReplicaResult(r.name) for r in self._replicas]
            self._rpcs = {}
            self._ranks_sent = False
            try:
                self._push(model, version, report, keep)
            except BaseException as e:
                self._layout = None  # whatever failed, plan the next push in full
                report.error = f"{type(e).__name__}: {e}"
                report.error_kind = type(e).__name__
                if isinstance(e, EngineHooksError):
                    e.report = report
                raise
            finally:
                for res, r in zip(report.replicas, self._replicas):
                    res.rpcs = self._rpcs.get(id(r), 0)
                self._pm.hook.push_finished(report=report)
            return report

    def _phase(self, name: str, report: PushReport, run: Callable[[], Any]) -> Any:
        return self._pm.hook.run_phase(phase=name, report=report, run=run)

    def _adapter(self, model: Any) -> TrainerAdapter:
        """The push's adapter, told the replicas' wire dtypes (kept while a layout is)."""
        if isinstance(model, TrainerAdapter):
            adapter = model
            if adapter.dtype is None and not adapter.dtypes:
                adapter.dtype, adapter.dtypes = self.wire_dtypes()
            return adapter
        default, exceptions = self.wire_dtypes()
        return adapter_for(model, dtype=default, dtypes=exceptions)

    def _options_key(self, adapter_key: str) -> str:
        """The layout key: the adapter's, and every push option the plan depends on."""
        return layout_key([adapter_key, self.transport_name, self.bucket_bytes, self.checksum,
                           self.transport.split, self.transport.direct_min, self.verify,
                           self.senders.size if self.senders is not None else None])

    def _prepared(self, adapter: TrainerAdapter, report: PushReport) -> PreparedLayout | None:
        """The kept layout if this push may use it: same replicas, group intact, same
        key (`core/layout.py`), with several senders every other rank's part the same
        too (`ask_reuse`), and for several senders or a shard-direct schedule every
        replica's `info` the same (`_replicas_hold`); else None (the full path)."""
        lay = self._layout
        if (lay is None or lay.replicas != self._replicas
                or self._sender is None or self._sender.broken
                or self._members != self._replicas):
            return None
        key = adapter.layout_key()
        if key is None or self._options_key(key) != lay.key:
            return None
        if not adapter.reuse_plan(lay.adapter, lay.specs):
            return None
        if self.senders is None and lay.needs is None:
            return lay
        if self.senders is None:  # one sender of a schedule: only the `info` check
            return lay if self._replicas_hold(lay, report, self._ask_infos()) else None
        if not isinstance(self._sender, SenderSet) or lay.owners is None:
            return None
        # Several senders learn of a replica that restarted here, before anything
        # streams, from one `info` each (its workers' instances and group): found in
        # the middle of the transfer instead, the other ranks would be left in their
        # lockstep gathers and sends until their timeouts, and could not fall back
        # within the push.
        # (The `info` calls run while the ranks answer `reuse`.)
        asked = self._ask_infos()
        refused, broken = ask_reuse(self._sender, lay.id)
        if not self._replicas_hold(lay, report, asked):
            return None
        if refused:
            report.layout = "fallback: " + "; ".join(refused)[:1000]
            if broken:  # that rank's group is gone: form the whole group anew
                self._close_group()
            return None
        if lay.needs is None:  # a schedule's senders send their shards: no parts
            adapter.owners = dict(lay.owners)  # this rank produces only its part
        return lay

    def _ask_infos(self) -> list[Future[Any]]:
        """Every replica's `info`, asked now (answered while the caller goes on)."""
        for r in self._replicas:
            self._count(r)
        return [spawn(r.info, self.timeout_s, name=f"enginehooks-info-{r.name}")
                for r in self._replicas]

    def _replicas_hold(self, lay: PreparedLayout, report: PushReport,
                       asked: list[Future[Any]]) -> bool:
        """Whether every replica's `info` (`_ask_infos`) says prepared layout `lay` still
        holds there: the same workers in the same group and, for a schedule, the same
        needs; else why not, in `report.layout`. Asked before anything streams: a worker
        that refused its layout once the data plane was busy would leave the others in
        their receives until their timeouts."""
        reps = list(self._replicas)
        infos = self._collect(report, "info", reps, asked, self.timeout_s)
        group = self._group_id()
        for k, (r, per) in enumerate(zip(reps, infos)):
            ids = [str(i["instance"]) for i in per if i.get("instance")]
            if ids != self._audience.get(id(r)) or any(i.get("group") != group for i in per):
                report.layout = (f"fallback: replica {r.name!r} restarted or left the "
                                 "group")
                return False
            if lay.needs is not None and [i.get(NEEDS_DIGEST_KEY) for i in per] != lay.needs[k]:
                # the schedule sends each worker what its copy plan read then: a plan
                # turned off, or recorded anew reading other bytes, needs a new schedule
                report.layout = (f"fallback: replica {r.name!r}'s copy plan changed since "
                                 "the schedule")
                return False
        return True

    def _push(self, model: Any, version: int | str, report: PushReport,
              keep: tuple[str, ...] = ()) -> None:
        """The push routine, for one sender and several. A push that leaves modules out
        (`keep`) takes the full path and keeps no layout: its manifest is not the
        model's whole layout."""
        if keep:
            self._layout = None
        if self._layout is not None:
            adapter = self._adapter(model)
            lay = self._phase("plan", report, lambda: self._prepared(adapter, report))
            if lay is not None:
                manifest = with_version(lay.manifest, version)
                report.layout = "prepared"
                self._receives = []
                try:
                    self._transact(adapter, manifest, report, lay)
                    return
                except BaseException as e:
                    self._layout, self._wire = None, None
                    gone = self._layout_gone()
                    if gone is None or _has_followers(adapter) or self.senders is not None:
                        # Other trainer ranks stream in lockstep with this one and are
                        # released now (STOP), or send parts of their own (several
                        # senders): they cannot follow a second stream in the same push,
                        # so the push fails; the next one plans in full (every rank
                        # dropped its part of the layout with the push's failed `end`).
                        self._cancel(adapter, manifest, f"{type(e).__name__}: {e}")
                        raise
                    # a replica lost the layout (restarted): nothing changed there; the
                    # others may have begun and failed with the broken group (torn):
                    # the full push below repairs them all
                    report.layout = f"fallback: {gone}"
                    report.phases.pop("transfer", None)
            self._layout = None
        self._push_full(model, version, report, keep)

    def _layout_gone(self) -> str | None:
        """After a failed prepared push: why a replica refused the layout, if one did
        (`LayoutUnknown`, which a worker answers at once), once every receive of that
        push ended (the full path must find no worker still busy with it)."""
        futs = self._receives
        wait(futs, timeout=min(GRACE_S, self.timeout_s), return_when=FIRST_EXCEPTION)
        why = next((f"replica {r.name!r}: {f.exception()}" for r, f in zip(self._replicas, futs)
                    if f.done() and isinstance(f.exception(), LayoutUnknown)), None)
        if why is not None:
            # The others' receives end when their data plane does: a collective group
            # with a member gone cannot carry an abort notice to them, so a receiver
            # waiting for a bucket waits out its own timeout (`timeout_s`).
            wait(futs, timeout=self.timeout_s + GRACE_S)
        return why

    def _push_full(self, model: Any, version: int | str, report: PushReport,
                   keep: tuple[str, ...] = ()) -> None:
        layout_id = uuid.uuid4().hex
        kept: dict[str, Any] = {}

        def make_plan() -> tuple[TrainerAdapter, Manifest]:
            adapter = self._adapter(model)
            meta: dict[str, Any] = {"transport": self.transport_name, "verify": self.verify}
            if keep:
                adapter = leave_out(adapter, keep, in_place=not isinstance(model, TrainerAdapter))
                meta[KEEP_KEY] = list(keep)
            layout: dict[str, Any] = dict(
                weight_version=version, bucket_bytes=self.bucket_bytes,
                checksum=self.checksum, split=self.transport.split,
                direct_min=self.transport.direct_min, meta=meta)
            if self.senders is None:
                key = (adapter.layout_key()
                       if not keep and all(r.prepared_layouts for r in self._replicas)
                       else None)
                specs = adapter.specs()
                if key is not None:  # the workers keep what they take under this id
                    meta[LAYOUT_KEY] = layout_id
                    kept.update(key=self._options_key(key), specs=specs)
                scheduled = self._scheduled(report, adapter, [specs], layout)
                if scheduled is not None:
                    if key is not None:
                        kept.update(needs=self._schedule_needs)
                    return adapter, scheduled
                if self.transport.schedules:
                    # broadcast for want of a schedule (`_scheduled`): kept as no
                    # layout, so the next push schedules once it can (a copy plan
                    # recorded by this push)
                    meta.pop(LAYOUT_KEY, None)
                    kept.clear()
                return adapter, plan(specs, **layout)
            # several senders: every rank says what it can stream; one manifest lists
            # each sender's part (and, for lockstep ranks, the order they send in), or
            # the shard-direct schedule (`_scheduled`) every rank sends its shards along
            key = (adapter.layout_key()
                   if all(r.prepared_layouts for r in self._replicas) else None)
            # the first command of a push: a rank whose send failed in the last push may
            # still be ending it (its transport's timeout), so wait for it that long too
            per_rank = ask_plans(self.senders, adapter, 2 * self.timeout_s + GRACE_S)
            if key is not None and self.transport.schedules:
                meta[LAYOUT_KEY] = layout_id  # kept only where a schedule is made
            scheduled = self._scheduled(report, adapter, per_rank, layout)
            if scheduled is not None:  # each rank sends its own shards (no parts)
                if key is not None:  # every rank keeps the schedule under this id
                    kept.update(key=self._options_key(key), specs=per_rank[0], owners={},
                                needs=self._schedule_needs)
                return adapter, scheduled
            # broadcast for want of a schedule: kept as no layout where the transport
            # schedules, so the next push schedules once it can
            meta.pop(LAYOUT_KEY, None)
            key = key if not self.transport.schedules else None
            if key is not None:  # every rank keeps its part under this id (`Follower`)
                meta[LAYOUT_KEY] = layout_id
            manifest = with_send_order(plan(parts=decide_parts(per_rank), **layout), per_rank)
            # this rank gathers, converts and casts only its own part (the others theirs)
            adapter.owners = owners_of(manifest, self.senders)
            if key is not None:
                kept.update(key=self._options_key(key), specs=per_rank[0],
                            owners=dict(adapter.owners))
            return adapter, manifest

        adapter, manifest = self._phase("plan", report, make_plan)
        self._transact(adapter, manifest, report, None)
        if kept and self._wire is not None:
            self._layout = PreparedLayout(layout_id, kept["key"], manifest, adapter,
                                          kept["specs"], list(self._replicas), self._wire,
                                          kept.get("owners"), kept.get("needs"))

    def _scheduled(self, report: PushReport, adapter: TrainerAdapter,
                   per_rank: list[list[TensorSpec]], layout: dict[str, Any]) -> Manifest | None:
        """For a transport that schedules (`Transport.schedules`: `shard`), the manifest
        with the static shard-direct schedule (`control/shard_schedule.py`): every
        engine worker's needs asked once (`info` with needs), each trainer rank's
        holdings read from its placements, the schedule computed once per layout (the
        `ShardPlanner` keeps it) and written into the manifest the check and receive
        tokens sign. None (the transport broadcasts over the same groups, the reason in
        `meta["schedule_off"]`) where no schedule can be made: a worker with no copy plan
        recorded yet (the first push records it), ranks that stream different tensors,
        placements other than FSDP2's `Shard(0)`/`Replicate()` on the sender ranks."""
        if not self.transport.schedules:
            return None
        meta = layout["meta"]
        senders = self.senders.size if self.senders is not None else 1
        try:
            if KEEP_KEY in meta:
                raise ConfigError("push(keep=...) is broadcast")
            specs = per_rank[0]
            if any(list(p) != list(specs) for p in per_rank[1:]):
                raise ConfigError("the trainer ranks stream different tensors")
            shards = shard_source(adapter, 0, senders)
            matching(specs, shards)
            infos = self._needs(report)
            self._schedule_needs = [[i.get(NEEDS_DIGEST_KEY) for i in per] for per in infos]
            if self._planner is None or self._planner.senders != senders:
                self._planner = ShardPlanner(senders)
            return self._planner.manifest(
                specs, shards.holds(), [(r.name, i) for r, i in zip(self._replicas, infos)],
                **layout)
        except ConfigError as e:  # MalformedNeeds is one
            meta[SCHEDULE_OFF_KEY] = f"{type(e).__name__}: {e}"[:500]
            return None

    def _needs(self, report: PushReport) -> list[list[dict[str, Any]]]:
        """Every replica's `info` with each worker's needs, asked once per layout: a plain
        `info` first; only where a worker's `needs_key` is not the digest of the needs
        held for that worker (by its id) from before are the needs asked
        (`InfoRequest(needs=True)`, of every replica; the cache then holds them)."""
        infos = self._all(report, "info", lambda r: r.info(self.timeout_s))
        held = self._needs_held
        if all(i.get(NEEDS_DIGEST_KEY) is not None
               and held.get(str(i.get("instance")), ("", None))[0] == i[NEEDS_DIGEST_KEY]
               for per in infos for i in per):
            return [[{**i, NEEDS_KEY: held[str(i["instance"])][1]} for i in per]
                    for per in infos]
        infos = self._all(report, "info", lambda r: r.request(
            wire.InfoRequest(needs=True), self.timeout_s))
        self.needs_asked += 1
        for per in infos:
            for i in per:
                if i.get(NEEDS_DIGEST_KEY) is not None and isinstance(i.get(NEEDS_KEY), dict):
                    held[str(i.get("instance"))] = (str(i[NEEDS_DIGEST_KEY]), i[NEEDS_KEY])
        return infos

    def _stream(self, adapter: TrainerAdapter, manifest: Manifest) -> Stream:
        """What this rank's sender sends from: the adapter's stream, or for a scheduled
        manifest a `ShardStream` (its own shards; the stream is never started)."""
        if SCHEDULE_KEY not in manifest.meta:
            return adapter.stream()
        senders = self.senders.size if self.senders is not None else 1
        return ShardStream(adapter.stream, lambda: shard_source(adapter, 0, senders))

    def _transact(self, adapter: TrainerAdapter, manifest: Manifest, report: PushReport,
                  prepared: PreparedLayout | None) -> None:
        report.bytes, report.buckets = manifest.total_bytes, len(manifest.buckets)
        report.tensors = len(manifest.tensors)
        try:
            self._group_check_transfer(adapter, manifest, report, prepared)
        except BaseException as e:
            # Sharded trainers: the other ranks iterate the same stream in lockstep and
            # wait for the sender's go; tell them this push is off, with the reason, so
            # they return instead of blocking in a collective (trainer_side.lockstep).
            # (A prepared push's failure is handled by `_push`, which may fall back.)
            if prepared is None:
                self._cancel(adapter, manifest, f"{type(e).__name__}: {e}")
            raise

    def _cancel(self, adapter: TrainerAdapter, manifest: Manifest, reason: str) -> None:
        """Release the ranks that stream in lockstep with this one (`adapter.cancel`),
        where a stream was started: a flag nobody reads would block this rank in its
        collective. So not for a scheduled manifest (its stream is never started), and
        with several senders only where they were told to send: before that they wait
        for a command, not a flag, and hear of the failure from the push's `end`."""
        if SCHEDULE_KEY in manifest.meta:
            return
        if self.senders is not None and not self._ranks_sent:
            return
        adapter.cancel(reason)

    def _count(self, r: EngineHandle, n: int = 1) -> None:
        with self._rpcs_lock:
            self._rpcs[id(r)] = self._rpcs.get(id(r), 0) + n

    def _finish(self, r: EngineHandle) -> None:
        if r.flush_pending():
            self._count(r)
            r.flush_cache(self.timeout_s, self._token("flush", r))

    def _group_check_transfer(self, adapter: TrainerAdapter, manifest: Manifest,
                              report: PushReport, prepared: PreparedLayout | None = None
                              ) -> None:
        if prepared is None:
            self._phase("group", report, self._ensure_group)
            manifest_json = manifest.to_json()
            self._phase("check", report, lambda: self._all(
                report, "check", lambda r: r.check(
                    manifest_json, self.timeout_s,
                    self._token("check", r, manifest=manifest_json))))
        pause = self.pause and not self.wake_up
        if self.wake_up:
            self._phase("wake_weights", report, lambda: self._all(
                report, "wake weights", self._wake_weights))
        if pause:
            self._all(report, "pause", lambda r: r.pause(self.timeout_s))
        try:
            text = (reference(prepared.id, manifest.weight_version)
                    if prepared is not None else None)
            self._phase("transfer", report,
                        lambda: self._transfer(manifest, adapter, report, text))
            # Flush while still paused: no request may reuse a prefix computed with the
            # old weights, and some engines refuse a flush while requests run.
            self._phase("finish", report, lambda: self._all(
                report, "finish", self._finish, count=False))
        finally:
            if pause:
                self._all(report, "resume", lambda r: r.resume(self.timeout_s))
        if self.wake_up:  # only after a good update: a torn engine stays asleep
            self._phase("wake_kv_cache", report, lambda: self._all(
                report, "wake KV cache", lambda r: r.wake_up(["kv_cache"], self.timeout_s)))

    def _wake_weights(self, r: EngineHandle) -> None:
        self._count(r)  # two calls: is_sleeping, then wake_up
        if r.is_sleeping(self.timeout_s) is False:
            raise ConfigError(f"replica {r.name!r} is awake: WeightSync(wake_up=True) pushes "
                              "to sleeping engines; use pause=True for awake ones")
        r.wake_up(["weights"], self.timeout_s)

    def _token(self, verb: str, r: EngineHandle, **fields: Any) -> str | None:
        """The signature of one control message to replica `r`, when a secret is set
        (`core/auth.py`): over the verb's payload (`wire/`), for the
        workers of `r` only (its audience)."""
        if not self.secret:
            return None
        return wire.token(self.secret, verb, self._audience.get(id(r), ()), **fields)

    def send_dtype(self) -> torch.dtype | None:
        """The dtype floating tensors travel in: `dtype=` if given, else the one the
        replicas run (they must agree). Sharded trainers cast shards to it before
        gathering."""
        return self.wire_dtypes()[0]

    def wire_dtypes(self) -> tuple[torch.dtype | None, dict[str, torch.dtype | None]]:
        """(default, exceptions by checkpoint name): the dtype the replicas run and the
        tensors their loaders put in parameters of another dtype (derived by each
        engine from its own loader), or (None) that their loaders compute on before
        they land, which travel in the trainer's own dtype. `WeightSync(dtype=...)`
        overrides the default. Kept while a prepared layout is (no call then)."""
        if self._layout is not None and self._wire is not None:
            kept_default, kept = self._wire
            return kept_default, dict(kept)
        scratch = PushReport(version="", transport=self.transport_name)
        infos = [i for per_replica in self._all(scratch, "info", lambda r: r.info(self.timeout_s))
                 for i in per_replica]
        default = self.dtype
        if default is None:
            dtypes = {i["dtype"] for i in infos if i.get("dtype")}
            if len(dtypes) > 1:
                raise ConfigError(
                    f"replicas run different dtypes {sorted(dtypes)}: pass WeightSync(dtype=...)")
            default = torch_dtype(dtypes.pop()) if dtypes else None
        exceptions: dict[str, torch.dtype | None] = {}
        for info in infos:
            for name, dt in (info.get("wire_dtypes") or {}).items():
                if name in exceptions and exceptions[name] != torch_dtype(dt):
                    raise ConfigError(f"replicas want tensor {name!r} in different dtypes")
                exceptions[name] = torch_dtype(dt)
        for info in infos:  # a loader that computes on a tensor gets it uncast, whatever
            for name in info.get("uncast") or []:  # another replica would cast it to
                exceptions[name] = None
        self._wire = (default, dict(exceptions))
        return default, exceptions

    # -- concurrency helpers ------------------------------------------------------------
    def _all(self, report: PushReport, what: str, call: Callable[[EngineHandle], Any],
             replicas: list[EngineHandle] | None = None, count: bool = True) -> list[Any]:
        """Run `call` on every replica concurrently; wait with the timeout; raise the
        first failure, naming its replica. Results in replica order. `count`: one call
        to each replica (`PushReport.rpcs`); False where `call` counts its own."""
        reps = self._replicas if replicas is None else replicas
        if count:
            for r in reps:
                self._count(r)
        futs = [spawn(call, r, name=f"enginehooks-{what}-{r.name}") for r in reps]
        return self._collect(report, what, reps, futs, self.timeout_s)

    def _collect(self, report: PushReport, what: str, reps: list[EngineHandle],
                 futs: list[Future[Any]], timeout_s: float) -> list[Any]:
        done, not_done = wait(futs, timeout=timeout_s, return_when=FIRST_EXCEPTION)
        if any(f.exception() is not None for f in done):
            self._settle(futs, Deadline.after(min(GRACE_S, timeout_s)))
            raise self._failure(report, what, reps, futs)
        if not_done:
            late = [r.name for r, f in zip(reps, futs) if f in not_done]
            for r, f in zip(reps, futs):
                if f in not_done:
                    self._mark(report, r, f"{what}: no answer within {timeout_s}s")
            raise PushTimeout(f"{what}: replicas {late} did not answer within {timeout_s}s")
        return [f.result() for f in futs]

    @staticmethod
    def _settle(futs: list[Future[Any]], deadline: Deadline) -> None:
        """After a failure, wait (until `deadline` at most) until it is clear which
        replica caused it: one reported an error of its own or did not answer, or every
        one has answered. Errors that are consequences of another party's failure (a
        closed connection) arrive first, from the healthy replicas; the one whose host
        disappeared says nothing."""
        pending = {f for f in futs if not f.done()}
        while pending:
            if any(blame(f.exception()) < STALLED for f in futs
                   if f.done() and f.exception() is not None):
                return
            done, pending = wait(pending, timeout=deadline.left(), return_when=FIRST_COMPLETED)
            if not done:
                return

    def _failure(self, report: PushReport, what: str, reps: list[EngineHandle],
                 futs: list[Future[Any]], wrap: bool = False) -> EngineHooksError:
        """The error a failed phase raises: that of the replica that caused it, with
        every other replica's outcome after it. The cause is the replica whose outcome
        is most its own (`blame`): its own error, else no answer, else a stalled data
        plane, and only then an error that another party's failure caused; replica
        order breaks ties. Our own errors keep their type (a refused manifest stays a
        `ManifestError`) unless `wrap`; anything else becomes a `ReplicaError`."""
        outcomes: list[tuple[EngineHandle, BaseException | None]] = []
        for r, f in zip(reps, futs):
            e = f.exception() if f.done() else None
            if f.done() and e is None:
                continue  # answered
            outcomes.append((r, e))
            self._mark(report, r, f"{what}: {type(e).__name__}: {e}" if e is not None
                       else f"{what}: no answer")
        ranked = sorted(outcomes, key=lambda o: blame(o[1]))
        r, e = ranked[0]
        others = "".join(
            f"; replica {o.name!r} meanwhile: "
            + ("no answer" if oe is None else f"{type(oe).__name__}: {str(oe)[:400]}")
            + (" (a consequence)" if blame(oe) == CONSEQUENCE else "")
            for o, oe in ranked[1:])
        if e is None:
            err: EngineHooksError = ReplicaError(
                r.name, f"{what}: no answer (unreachable, or its host is down) while the "
                        f"push failed{others}")
        elif isinstance(e, EngineHooksError) and not wrap:
            e.replica = e.replica or r.name
            if len(e.args) == 1 and str(e) == e.args[0]:
                # The trainer reads which replica, whichever path the error took (a
                # worker's ChecksumError said only "bucket 8: ..." here).
                text = str(e) if repr(r.name) in str(e) else f"replica {r.name!r}: {what} failed: {e}"
                e.args = (f"{text}{others}",)
            return e
        elif isinstance(e, VERDICTS):
            # The replica's own verdict (a bad digest, a refused token or manifest)
            # keeps its class even where other errors are wrapped (issue 19): the
            # trainer catches a ChecksumError as one, with the replica in its text.
            err = wire.restore_error(
                type(e).__name__, f"replica {r.name!r}: {what} failed: {e}{others}", r.name)
            err.__cause__ = e
        else:
            err = ReplicaError(r.name, f"{what} failed: {type(e).__name__}: {e}{others}")
            err.__cause__ = e
        return err

    def _mark(self, report: PushReport, r: EngineHandle, error: str) -> None:
        for res in report.replicas:
            if res.name == r.name and res.error is None:
                res.ok, res.error = False, error

    # -- group ----------------------------------------------------------------------------
    def _group_id(self, sender: Sender | None = None) -> str | None:
        """The id of `sender`'s group (the current one by default), as the workers
        record it from the endpoint."""
        sender = self._sender if sender is None else sender
        return wire.group_id(sender.endpoint() if sender is not None else None)

    def _ensure_group(self) -> None:
        """Form the group, or keep it when the members are the same and every worker
        still belongs to it (an engine restarted since, or taken over by another
        trainer, reports another group: then the group is formed anew)."""
        scratch = PushReport(version="", transport=self.transport_name)
        infos = self._all(scratch, "info", lambda r: r.info(self.timeout_s))
        for r, per in zip(self._replicas, infos):
            wire.check_infos(per, r.name, secret=bool(self.secret))
            self._audience[id(r)] = [str(i["instance"]) for i in per if i.get("instance")]
        sender, group = self._sender, self._group_id()
        if (sender is not None and self._members == self._replicas and not sender.broken
                and all(i.get("group") == group for per in infos for i in per)):
            return
        self._close_group()
        counts = [len(i) for i in infos]
        world = 1 + sum(counts)
        sender = self._open_sender()
        if self.senders is not None:  # the other ranks open theirs (`SenderSet`)
            sender = SenderSet(sender, self.senders, self.timeout_s)
        endpoint = dict(sender.endpoint(), world_size=world)
        if self.on_torn is not None:
            endpoint["on_torn"] = self.on_torn
        offsets, acc = [], 1
        for c in counts:
            offsets.append(acc)
            acc += c
        for r in self._replicas:
            self._count(r)
        futs = [spawn(r.join, endpoint, off, self.timeout_s,
                      self._token("join", r, endpoint=endpoint, rank_offset=off),
                      name=f"enginehooks-join-{r.name}")
                for r, off in zip(self._replicas, offsets)]
        try:
            self._connect(sender, world, futs)
        except BaseException:
            # Report which replica kept the group from forming, if one said why.
            self._collect(scratch, "join", self._replicas, futs, 0.1)
            sender.close()
            raise
        try:
            self._collect(scratch, "join", self._replicas, futs, self.timeout_s)
        except BaseException:
            # The other replicas' joins end at once once the group is called off
            # (`_connect`): let them, so the next push finds no worker still busy.
            wait(futs, timeout=min(GRACE_S, self.timeout_s))
            sender.close()
            raise
        self._sender, self._members = sender, list(self._replicas)

    def _open_sender(self) -> Sender:
        """This rank's sender, from the transport (the `update_group` hook)."""
        options = {"host": self.host, "port": self.port, "timeout_s": self.timeout_s,
                   "device": self.device, "secret": self.secret, **self.transport_options}
        return JoinSender(self.transport_name, options).ask(self._pm)

    def _leave_sender(self, sender: Sender) -> None:
        LeaveSender(self.transport_name, sender).ask(self._pm)

    def _connect(self, sender: Sender, world: int, joins: list[Future[Any]]) -> None:
        """Form the group, ending at once when a replica refuses its join (a missing
        secret, a wrong world size, no worker extension): the refusal is known in
        milliseconds, so the push must not wait out `timeout_s` for peers that will
        never come."""
        connect = spawn(sender.connect, world, name="enginehooks-connect")
        deadline = Deadline.after(self.timeout_s)
        pending: set[Future[Any]] = {connect, *joins}
        while not connect.done():
            done, pending = wait(pending, timeout=deadline.left(), return_when=FIRST_COMPLETED)
            failed = [f.exception() for f in done if f is not connect and f.exception()]
            if failed:
                # End the wait of every rank that did arrive (the other replicas'
                # workers block in the group's rendezvous otherwise, until its timeout).
                call_off = getattr(sender, "call_off", None)
                if callable(call_off):
                    with contextlib.suppress(Exception):
                        call_off(f"a replica refused its join: {type(failed[0]).__name__}: "
                                 f"{failed[0]}")
                return  # the caller reports the replica's error (and closes the sender)
            if not done:
                raise PushTimeout(f"group: the transport group of {world} did not form within "
                                  f"{self.timeout_s}s")
        connect.result()

    def _close_group(self, wait_for_leaves: bool = True) -> None:
        """Leave on every member and close the sender. Best effort and bounded: a dead
        replica must not keep the group from closing; after a failure the leaves are
        not waited for at all (the push must fail within its timeout)."""
        sender, members = self._sender, self._members
        self._sender, self._members = None, []
        if sender is None:
            return
        # Each leave names the group it leaves: one delivered late (sent during a
        # partition, retransmitted once it healed, after the next push's join) is
        # ignored by a worker that is in a newer group by then (`EngineSide.leave`).
        group = self._group_id(sender)
        for r in members:
            self._count(r)
        futs = [spawn(r.leave, self.timeout_s, wire.leave_message(
                    group, self._token("leave", r, group=group)))
                for r in members]
        if wait_for_leaves:
            wait(futs, timeout=self.timeout_s)
        self._leave_sender(sender)

    # -- transfer -------------------------------------------------------------------------
    def _transfer(self, manifest: Manifest, adapter: TrainerAdapter, report: PushReport,
                  text: str | None = None) -> None:
        """Stream `manifest` to every replica; `text`: what each replica's `receive`
        gets instead of the whole manifest (a prepared layout's reference)."""
        sender = self._sender
        if sender is None:
            raise TransportError("no transport group formed before the transfer")
        abort = Abort()
        reps = list(self._replicas)

        group = self._group_id() or ""

        def abort_on_failure(name: str, f: Future[Any]) -> None:
            if (e := f.exception()) is not None:
                abort.fail(ReplicaError(name, f"{type(e).__name__}: {e}"))

        def start_receivers(m: Manifest) -> list[Future[Any]]:
            arg = text if text is not None else m.to_json()
            for r in reps:
                self._count(r)
            futs = [spawn(r.receive, arg, group, self.timeout_s,
                          self._token("receive", r, manifest=arg, group=group),
                          name=f"enginehooks-recv-{r.name}")
                    for r in reps]
            for r, f in zip(reps, futs):
                f.add_done_callback(functools.partial(abort_on_failure, r.name))
            self._receives = futs
            return futs

        futs: list[Future[Any]] = []
        if self.transport.streaming:
            futs = start_receivers(manifest)
        try:
            stats = self._pm.hook.send_weights(
                transport=self.transport_name, sender=sender, manifest=manifest,
                stream=self._stream(adapter, manifest), abort=abort,
            )
        except BaseException as e:
            self._ranks_sent = bool(getattr(sender, "started", False))
            # A replica's own error says more than the sender's "aborted": prefer it. The
            # receivers learn of a sender-side failure through the abort notice, so give
            # them a moment to report before the group is torn down under them; then
            # name the replica that caused the failure, not the first to answer (a
            # healthy one whose connection the sender closed answers before one whose
            # host is gone, which never does).
            cause: EngineHooksError | None = None
            if futs:
                grace = Deadline.after(min(GRACE_S, self.timeout_s))
                done, _ = wait(futs, timeout=grace.left(), return_when=FIRST_EXCEPTION)
                # The only replica did not answer at all while the data plane failed: on a
                # prepared push the receive call is the first this push makes, so a
                # replica cut off before the push began is named here, as `info` names
                # it on the full path. (With several, the healthy ones wait for bytes too
                # and none can be singled out: the sender's error stands.)
                if (isinstance(e, TransportError) and len(reps) == 1
                        and not futs[0].done()):
                    self._mark(report, reps[0], "receive: no answer")
                    cause = ReplicaError(reps[0].name, "receive: no answer (unreachable, or "
                                         f"its host is down) while {e}")
                elif any(f.exception() is not None for f in done):
                    self._settle(futs, grace)
                    failure = self._failure(report, "receive", reps, futs, wrap=True)
                    # The sender's own error (the trainer's stream broke) is the
                    # cause; a data-plane error is better told by the replicas.
                    if isinstance(e, TransportError):
                        cause = failure
            # Whatever failed, the group's state is unknown now: rebuild it next time.
            self._close_group(wait_for_leaves=False)
            if cause is not None:
                raise cause from e
            raise
        report.sender = dict(getattr(stats, "extra", None) or {})
        if not self.transport.streaming:
            futs = start_receivers(stats.manifest or manifest)
        try:
            results = self._collect(report, "receive", reps, futs, self.timeout_s)
        except BaseException:
            self._close_group(wait_for_leaves=False)
            raise
        for res, out in zip(report.replicas, results):
            res.ok = True
            res.seconds = max((w.get("seconds", 0.0) for w in out), default=0.0)
            res.stats = {"workers": out}

    def push_adapter(self, model: Any, version: int | str, *, adapter: str = "default",
                     name: str | None = None, keep: int = 2) -> AdapterReport:
        """Push PEFT model `model`'s LoRA adapter `adapter` as `version`, unmerged: only
        the adapter's bytes move, and every replica loads them with the engine's own
        adapter loader beside its base weights (all replicas, or none). Requests then
        generate with it as model `report.served` (`name@version`; `name` defaults to the
        adapter's); the newest `keep` versions stay loaded, older ones are unloaded.
        Replicas must serve LoRA at runtime (vLLM: `--enable-lora`,
        `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`); docs/trainers.md."""
        if self.senders is not None and not self.senders.coordinator:
            raise ConfigError("push_adapter runs on the coordinator (rank 0) only: an adapter "
                              "is gathered there, e.g. by PEFT's save_pretrained")
        with self._lock:
            if not self._replicas:
                raise EngineHooksError("push_adapter() with no replica registered "
                                       "(add_replica first)")
            upload = adapter_upload(model, version, adapter=adapter, name=name)
            return self._adapters.push(self._replicas, upload, keep, self.timeout_s)

    def close(self) -> None:
        """Leave the group on every replica and close the sender (bounded by timeouts).
        With several senders, call it on every rank (rank 0 tells the others)."""
        if self._follower is not None:
            self._follower.close()
            return
        with self._lock:
            self._close_group()
        if self.senders is not None:
            self._tell(Bye())

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
