"""`MultiSenderSync`: every trainer rank sends its part of one update (`docs/scale.md`).

One sender's link caps an update across nodes (a 1T-parameter model takes ~54 s through
one 400 Gb/s NIC). With k trainer ranks sending, each rank ships only its part, all at
once, each over its own broadcast group (`transports/multisender.py`), under one
manifest and one update id (`control/senders.py`):

- rank 0 (the coordinator) is a `WeightSync`: it talks to the engines (info, check,
  join, receive, flush) exactly as with one sender, and drives the other ranks through
  `TrainerRanks` (JSON over a gloo group of the trainer);
- every rank says which tensors it can stream; the coordinator plans one manifest:
  ranks that each stream the whole model (FSDP ranks gathering in lockstep) get a
  balanced share, ranks that each own a part send that part;
- every engine worker joins every sender's group and accepts each part with the
  ordinary receiver: same validation, digests, signatures and timeouts; a failure of
  any part ends the update on every worker (which closes every group) and the error
  names the sender rank;
- ranks that gather in lockstep send their buckets in an order fixed by the stream
  (`send_order`: each bucket at the position of the tensor that seals it); the
  coordinator writes it into the manifest (`meta["order"]`) and NCCL workers receive
  the buckets of all parts in exactly that order, which is what makes the update free
  of a cycle between the lockstep, the senders' two buffers and the workers' pending
  receives (the argument is in `transports/multisender.py`).

Use: build the same `MultiSenderSync(ranks, ...)` on every rank, each with its own
`host` (the address its group listens on); register the replicas on rank 0; call
`push(model, version)` and `close()` on every rank at the same point of the loop. The
control group must be a group of its own (`dist.new_group(backend="gloo")`), not the
one a sharded adapter gathers on. After a rank died, rebuild the process group.

Over `nccl` every rank's sender uses its own GPU: `device` where given (each rank passes
its own), else the rank's current CUDA device (`torch.cuda.set_device` before the first
push); each engine worker receives the parts in the send order on one stream
(`transports/multisender.py`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from enginehooks.control.handles import EngineHandle
from enginehooks.control.ranks import RanksBroken, TrainerRanks
from enginehooks.control.report import PushReport
from enginehooks.control.senders import decide_parts, parts, plan_senders
from enginehooks.control.sync import WeightSync
from enginehooks.core.dtypes import dtype_name, torch_dtype
from enginehooks.core.errors import ConfigError, TransportError
from enginehooks.core.manifest import Manifest, TensorSpec
from enginehooks.trainer_side.contract import TrainerAdapter, adapter_for
from enginehooks.trainer_side.lockstep import PushAborted
from enginehooks.transports.base import Abort, SendStats
from enginehooks.transports.broadcast import BroadcastSender
from enginehooks.transports.multisender import ORDER_KEY, only, send_order

TRANSPORTS = ("gloo", "nccl")


def _encode(specs: list[TensorSpec]) -> list[list[Any]]:
    return [[s.name, s.dtype, list(s.shape)] for s in specs]


def _decode(raw: Any, rank: int) -> list[TensorSpec]:
    try:
        return [TensorSpec(str(n), str(d), tuple(int(x) for x in shape)) for n, d, shape in raw]
    except (TypeError, ValueError) as e:
        raise ConfigError(f"trainer rank {rank} sent a malformed plan: {e}") from None


class MultiSenderSync(WeightSync):
    """A `WeightSync` whose update every rank of `ranks` sends a part of (module
    docstring). Keyword arguments are `WeightSync`'s; `host` is this rank's address."""

    def __init__(self, ranks: TrainerRanks, transport: str = "gloo", **kwargs: Any) -> None:
        if transport not in TRANSPORTS:
            raise ConfigError(f"several senders run over {TRANSPORTS}, not {transport!r} "
                              "(docs/scale.md)")
        super().__init__(transport, **kwargs)
        self.ranks = ranks
        # the transport's sender() builds the coordinator's `SenderSet` from this
        self.transport_options["trainer_ranks"] = ranks
        self._sender_here: BroadcastSender | None = None  # followers: this rank's sender
        self._adapter: TrainerAdapter | None = None
        self._last: list[Any] = []

    # -- rank 0 only ----------------------------------------------------------------------
    def add_replica(self, handle: EngineHandle) -> None:
        if not self.ranks.coordinator:
            raise ConfigError(f"trainer rank {self.ranks.rank}: register replicas on rank 0, "
                              "the coordinator")
        super().add_replica(handle)

    def connect(self) -> None:
        raise ConfigError("with several senders the group forms inside push(), which every "
                          "rank calls")

    def push(self, model: Any, version: int | str) -> PushReport:
        """Push on every rank. Rank 0 returns the report; the other ranks return a report
        of their own part (bytes, seconds), and raise when the push failed anywhere."""
        if self.device is None and self.transport_name == "nccl":
            # each rank's sender on its own GPU (the current device of the rank's
            # process), not on the coordinator's
            self.device = torch.device("cuda", torch.cuda.current_device())
        if not self.ranks.coordinator:
            return self._follow(model, version)
        try:
            report = super().push(model, version)
        except BaseException as e:
            self._tell({"op": "end", "ok": False, "error": f"{type(e).__name__}: {e}"[:4000]})
            raise
        self._tell({"op": "end", "ok": True})
        return report

    def _tell(self, message: dict[str, Any]) -> None:
        if self.ranks.broken is None:
            with contextlib.suppress(RanksBroken):
                self._last = self.ranks.post(message)  # kept until it completes

    def _push(self, model: Any, version: int | str, report: PushReport) -> None:
        def make_plan() -> tuple[TrainerAdapter, Manifest]:
            if isinstance(model, TrainerAdapter):
                adapter = model
                if adapter.dtype is None and not adapter.dtypes:
                    adapter.dtype, adapter.dtypes = self.wire_dtypes()
            else:
                default, exceptions = self.wire_dtypes()
                adapter = adapter_for(model, dtype=default, dtypes=exceptions)
            self.ranks.broadcast({
                "op": "plan", "dtype": dtype_name(adapter.dtype) if adapter.dtype else None,
                "dtypes": {n: dtype_name(d) if d is not None else None
                           for n, d in adapter.dtypes.items()}})
            mine = adapter.specs()
            answers = self.ranks.gather({"ok": True, "specs": _encode(mine)})
            bad = [f"trainer rank {j}: {a.get('error')}" for j, a in enumerate(answers)
                   if not a.get("ok")]
            if bad:
                raise ConfigError("planning failed on " + "; ".join(bad))
            per_rank = [mine] + [_decode(a["specs"], j) for j, a in enumerate(answers) if j]
            manifest = plan_senders(
                decide_parts(per_rank), weight_version=version, bucket_bytes=self.bucket_bytes,
                checksum=self.checksum, split=self.transport.split,
                meta={"transport": self.transport_name, "verify": self.verify},
                direct_min=getattr(self.transport, "direct_min", None))
            if all(list(p) == list(mine) for p in per_rank[1:]):
                # lockstep ranks: the order they send in, which receivers follow
                # (`transports/multisender.py`: what keeps NCCL free of a cycle)
                order = send_order(manifest, [s.name for s in mine])
                if order is not None:
                    d = manifest.to_dict()
                    d["meta"] = {**d["meta"], ORDER_KEY: order}
                    manifest = Manifest.from_dict(d)
            return adapter, manifest

        adapter, manifest = self._phase("plan", report, make_plan)
        report.bytes, report.buckets = manifest.total_bytes, len(manifest.buckets)
        report.tensors = len(manifest.tensors)
        try:
            self._group_check_transfer(adapter, manifest, report)
        except BaseException as e:
            adapter.cancel(f"{type(e).__name__}: {e}")
            raise

    def close(self) -> None:
        """On every rank: close the groups (rank 0 tells the others)."""
        if self.ranks.coordinator:
            super().close()
            self._tell({"op": "bye"})
            return
        try:
            self._serve(None, None, until="bye")
        finally:
            if self._sender_here is not None:
                self._sender_here.close()
                self._sender_here = None

    # -- the other ranks ------------------------------------------------------------------
    def _follow(self, model: Any, version: int | str) -> PushReport:
        report = PushReport(version=version, transport=self.transport_name)
        stats = self._serve(model, version, until="end")
        if stats is not None:
            report.bytes, report.buckets = stats.bytes, stats.buckets
        return report

    def _serve(self, model: Any, version: int | str | None, until: str) -> SendStats | None:
        """Answer rank 0's commands until `until` (module docstring)."""
        ranks, rank = self.ranks, self.ranks.rank
        long_wait = 6 * self.timeout_s + 60.0
        failed: str | None = None
        stats: SendStats | None = None
        while True:
            cmd = ranks.broadcast(None, timeout_s=self.timeout_s if failed else long_wait)
            op = cmd.get("op") if isinstance(cmd, dict) else None
            if op in ("end", "bye"):
                if op == "end" and not cmd.get("ok"):
                    raise PushAborted(f"trainer rank {rank}: the push failed: "
                                      f"{cmd.get('error')}", str(cmd.get("error")))
                if failed is not None:
                    raise TransportError(failed)
                if op == until or op == "bye":
                    return stats
                continue
            if op == "plan":
                try:
                    answer = {"ok": True, "specs": _encode(self._plan(model, cmd))}
                except Exception as e:
                    answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                ranks.gather(answer)
                continue
            try:
                answer, stats = self._handle(op, cmd, stats)
            except Exception as e:
                answer = {"ok": False, "error": f"{type(e).__name__}: {e}"[:4000]}
                if op == "send":
                    failed = f"trainer rank {rank}: sending its part failed: {answer['error']}"
            ranks.gather_short(answer).result(self.timeout_s)

    def _plan(self, model: Any, cmd: dict[str, Any]) -> list[TensorSpec]:
        dtype = torch_dtype(cmd["dtype"]) if cmd.get("dtype") else None
        dtypes = {n: torch_dtype(d) if d is not None else None
                  for n, d in (cmd.get("dtypes") or {}).items()}
        if isinstance(model, TrainerAdapter):
            adapter = model
            if adapter.dtype is None and not adapter.dtypes:
                adapter.dtype, adapter.dtypes = dtype, dtypes
        else:
            adapter = adapter_for(model, dtype=dtype, dtypes=dtypes)
        self._adapter = adapter
        return adapter.specs()

    def _handle(self, op: Any, cmd: dict[str, Any], stats: SendStats | None
                ) -> tuple[dict[str, Any], SendStats | None]:
        if op == "open":
            if self._sender_here is not None:
                self._sender_here.close()
            options = {k: v for k, v in self.transport_options.items() if k != "trainer_ranks"}
            self._sender_here = BroadcastSender(
                self.transport_name, **{"host": self.host, "port": self.port,
                                        "timeout_s": self.timeout_s, "device": self.device,
                                        "secret": self.secret, **options})
            return {"ok": True, "endpoint": self._sender_here.endpoint()}, stats
        if op == "connect":
            self._here(connected=False).connect(int(cmd["world"]))
            return {"ok": True}, stats
        if op == "send":
            if self._adapter is None:
                raise TransportError("send before plan")
            part = parts(Manifest.from_json(cmd["manifest"]))[self.ranks.rank]
            names = {t.name for t in part.tensors}
            stats = self._here().send(part, only(self._adapter.stream(), names), Abort())
            return {"ok": True, "seconds": stats.seconds, "bytes": part.total_bytes}, stats
        if op == "close":
            if self._sender_here is not None:
                self._sender_here.close()
                self._sender_here = None
            return {"ok": True}, stats
        raise ConfigError(f"unknown command {op!r} from trainer rank 0")

    def _here(self, connected: bool = True) -> BroadcastSender:
        if self._sender_here is None or (connected and self._sender_here.broken):
            raise TransportError(f"trainer rank {self.ranks.rank} has no open sender")
        return self._sender_here
