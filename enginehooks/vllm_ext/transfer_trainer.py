"""enginehooks as a vLLM weight-transfer backend, trainer side.

vLLM's trainer-side API builds an engine from its init info and drives the inference
side through a client (`VLLMWeightSyncClient`: vLLM's HTTP or Ray client, or
`enginehooks.vllm_ext.VLLMEngine` / `VLLMServer`, which implement the protocol too):

    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory)
    from enginehooks.vllm_ext.transfer_trainer import EnginehooksTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        EnginehooksTrainerInitInfo(rank=0, world_size=1 + vllm_workers, transport="gloo"),
        client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
    report = engine.send_weights(weight_version=step)

Importing this module registers the trainer side as backend "enginehooks" (vLLM's
trainer process does not load vLLM's general plugins). Underneath it is a `WeightSync`
with one replica, `ClientReplica`, that speaks vLLM's weight-sync calls: every call
runs under the push's timeout (vLLM's Ray client waits without one), the manifest is
checked by every worker before the data moves, and `send_weights` returns the push's
`PushReport` (and raises, with the report attached, when the push fails).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
)

from enginehooks import wire
from enginehooks.control.handles import EngineHandle
from enginehooks.control.report import PushReport
from enginehooks.control.sync import DEFAULT_BUCKET_BYTES, WeightSync
from enginehooks.core.dtypes import torch_dtype
from enginehooks.core.errors import ConfigError, EngineHooksError, ManifestError, ReplicaError
from enginehooks.core.manifest import TensorSpec
from enginehooks.trainer_side.contract import TrainerAdapter
from enginehooks.vllm_ext.transfer_engine import BACKEND
from enginehooks.wire.replies import WorkerInfo


@dataclass
class EnginehooksTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of backend "enginehooks".

    `world_size`: the sender plus every inference worker it pushes to (vLLM's NCCL
    backend counts the same way). The rest are `WeightSync`'s options: `transport`
    (any registered enginehooks transport), the rendezvous `host`/`port` the workers
    must reach, `bucket_bytes`, `timeout_s` (every wait), `checksum`, `dtype` (cast
    floating tensors to it; by default they travel as the source yields them and a
    worker refuses a dtype its loader would not take), `device` (the sender's buffers),
    `transport_options`, and the replica's `name` in reports and errors (default: the
    client's `name` if it has one, else "vllm").
    """

    backend: ClassVar[str] = BACKEND

    world_size: int = 2
    transport: str = "gloo"
    host: str = "127.0.0.1"
    port: int = 0
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 120.0
    checksum: str | None = "auto"
    dtype: str | None = None
    device: str | None = None
    transport_options: dict[str, Any] = field(default_factory=dict)
    name: str | None = None
    #: push into the deployment's speculative draft model (vLLM's
    #: `start_draft_weight_update`) instead of its main model
    draft: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 2:
            raise ConfigError(f"world_size must count the sender and at least one worker "
                              f"(>= 2), got {self.world_size!r}")


class WeightSourceAdapter(TrainerAdapter):
    """A vLLM `WeightSource` (e.g. `ModuleSource(model)`) as an enginehooks trainer
    adapter: the plan is the source's `metadata()`, the stream its iteration, with the
    names it yields (vLLM's loader takes them; the workers' check says if it would
    not). Iteration is checked against the metadata as it goes, so a source whose two
    channels disagree fails naming the tensor instead of sending the wrong bytes."""

    name = "vllm-weight-source"

    @classmethod
    def accepts(cls, model: Any) -> bool:
        return isinstance(model, WeightSource)

    def specs(self) -> list[TensorSpec]:
        return [self.wire_spec(m.name, m.dtype, tuple(m.shape)) for m in self.model.metadata()]

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        meta = self.model.metadata()
        sent = 0
        with torch.no_grad():
            for name, tensor in self.model:
                if sent >= len(meta) or meta[sent].name != name:
                    want = meta[sent].name if sent < len(meta) else "nothing more"
                    raise ManifestError(f"WeightSource yielded {name!r} where its metadata() "
                                        f"declared {want!r}")
                if tuple(tensor.shape) != tuple(meta[sent].shape):
                    raise ManifestError(f"WeightSource yielded {name!r} with shape "
                                        f"{list(tensor.shape)}, metadata() said "
                                        f"{list(meta[sent].shape)}")
                sent += 1
                yield name, self.to_wire(tensor, name)
        if sent != len(meta):
            raise ManifestError(f"WeightSource yielded {sent} tensors, metadata() declared "
                                f"{len(meta)}")


def _detail(e: BaseException) -> str:
    """An error's text, with the server's answer where a `requests` error hides it, and
    a JSON error body (vLLM's `{"error": {"message": ...}}`) reduced to its message."""
    text = f"{type(e).__name__}: {e}"
    response = getattr(e, "response", None)
    body = getattr(response, "text", None)
    if body:
        text += f" -> {body[:2000]}"
    start = text.find("{")
    if start >= 0:
        try:
            answer = json.loads(text[start:])
        except ValueError:
            return text
        error = answer.get("error") if isinstance(answer, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        if isinstance(message, str):
            return text[:start] + message
    return text


def _refused(who: str, verb: str, e: BaseException) -> Exception:
    """The error of a call vLLM's client relayed. vLLM's calls answer nothing and its
    clients keep only the error text, so the workers of backend "enginehooks" put the
    error's class into that text as an envelope (`wire.relay_text`): it is restored
    from there, never from the words. A missing route is told by the HTTP status (404:
    vLLM not in dev mode); anything else is a `ReplicaError`."""
    detail = _detail(e)
    found = wire.relayed_envelope(detail)
    if found is None and isinstance(e, EngineHooksError) and not isinstance(e, ReplicaError):
        # raised by the client itself (enginehooks' own VLLMServer / VLLMEngine): its class
        # is the answer (a route the server lacks is already a ConfigError saying the fix)
        e.replica = who
        return e
    if found is not None:
        kind, message = found
        restored = wire.restore_error(kind, f"replica {who!r}: {verb}: {message}", who)
        if type(restored) is ReplicaError:
            return ReplicaError(who, f"{verb} failed: {kind}: {message}")
        return restored
    response = getattr(e, "response", None)
    status = getattr(e, "status", None) or getattr(response, "status_code", None)
    if status == 404:
        # The route is missing: vLLM registers its weight-transfer routes in dev mode only.
        out = ConfigError(
            f"replica {who!r}: {verb}: the server has no such route ({detail[:300]}): start "
            "vLLM with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config "
            "'{\"backend\": \"enginehooks\"}'")
        out.replica = who
        return out
    return ReplicaError(who, f"{verb} failed: {detail}")


class ClientReplica(EngineHandle):
    """One vLLM deployment reached through a `VLLMWeightSyncClient` (its workers run
    backend "enginehooks"), as a `WeightSync` replica.

    The contract's verbs map onto vLLM's calls: `join` is `init_weight_transfer_engine`,
    `check` is `start_weight_update` then `update_weights` in phase "check", `receive`
    is `update_weights` in phase "receive", and `flush_cache` (the push's finish) is
    `finish_weight_update(version)`, which vLLM records as its weight version. Calls a
    client may lack are used only where it has them, under vLLM's names:
    `shutdown_weight_transfer_engine` (leave), `reset_prefix_cache` (after finish), and
    `update_weight_version` (records `torn` after a failed update). vLLM's own HTTP and
    Ray clients have none of the last two: with them, pause with `clear_cache` (vLLM's
    default) around the push, as every vLLM backend requires.

    vLLM's calls answer nothing, so `info` cannot ask the workers: it reports `workers`
    of them, and the per-worker stats of a receive do not travel back.
    """

    #: vLLM's client protocol carries the whole manifest on every update
    prepared_layouts = False

    def __init__(self, client: Any, workers: int, name: str = "vllm",
                 dtype: str | None = None, draft: bool = False) -> None:
        start = "start_draft_weight_update" if draft else "start_weight_update"
        for method in ("init_weight_transfer_engine", start, "update_weights",
                       "finish_weight_update"):
            if not callable(getattr(client, method, None)):
                raise ConfigError(f"{client!r} is not a vLLM weight-sync client: it has no "
                                  f"{method}()" + (" (VLLMServer has)" if draft else ""))
        self._start = getattr(client, start)
        self.client = client
        self.workers = int(workers)
        self.name = name
        self.dtype = dtype
        self._version: str | None = None
        self._in_session = False
        self._updates = 0
        self._group: str | None = None

    def rpc(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        raise ConfigError(f"replica {self.name!r} is reached through vLLM's weight-sync calls "
                          "only; for enginehooks RPCs start vLLM with the worker extension "
                          "and use VLLMEngine / VLLMServer")

    def info(self, timeout_s: float) -> list[WorkerInfo]:
        # vLLM's calls cannot ask the workers: the group is the one this handle joined.
        # `authenticated` is unknown here (None): an engine without the secret refuses
        # the signed join itself (EngineSide._authorize), so a trainer with a secret
        # still never pushes into an engine that would accept anyone's push. The dtype
        # is the init info's (the workers refuse one their loader would not take).
        out: list[WorkerInfo] = []
        for rank in range(self.workers):
            info = WorkerInfo(rank=rank, group=self._group, authenticated=None)
            if self.dtype is not None:
                info["dtype"], info["wire_dtypes"] = self.dtype, {}
            out.append(info)
        return out

    def join(self, endpoint: dict[str, Any], rank_offset: int, timeout_s: float,
             auth: str | None = None) -> None:
        # `workers`: the count this trainer assumes (from its world_size); every worker
        # refuses the join at once if the deployment has another (a group formed with
        # the wrong world size would wait out timeout_s for peers that never come).
        try:
            self.client.init_weight_transfer_engine({
                "endpoint": endpoint, "rank_offset": rank_offset, "auth": auth,
                "workers": self.workers})
        except Exception as e:
            raise _refused(self.name, "join", e) from e
        self._group = wire.group_id(endpoint) or ""

    def leave(self, timeout_s: float, auth: str | None = None) -> None:
        shutdown = getattr(self.client, "shutdown_weight_transfer_engine", None)
        if callable(shutdown):
            shutdown()

    def check(self, manifest_json: str, timeout_s: float, auth: str | None = None) -> None:
        if self._in_session:
            # The last push ended between start and finish (another replica failed):
            # close that session first; this backend holds nothing open in it.
            self.client.finish_weight_update()
            self._in_session = False
        self._start()  # vLLM's start_weight_update, or start_draft_weight_update
        self._in_session = True
        try:
            self.client.update_weights({"manifest": manifest_json, "phase": "check",
                                        "auth": auth})
        except Exception as e:
            self._in_session = False  # vLLM ends the session when update_weights raises
            refused = _refused(self.name, "check", e)
            if isinstance(refused, ManifestError):
                found = wire.relayed_envelope(_detail(e))
                raise ManifestError(f"replica {self.name!r} refused the update: "
                                    f"{found[1] if found else refused}") from e
            raise refused from e

    def receive(self, manifest_json: str, group: str, timeout_s: float,
                auth: str | None = None) -> list[dict[str, Any]]:
        version = str(json.loads(manifest_json)["weight_version"])
        self._updates += 1
        try:
            self.client.update_weights({"manifest": manifest_json, "phase": "receive",
                                        "group": group, "auth": auth})
        except Exception as e:
            self._in_session = False
            mark = getattr(self.client, "update_weight_version", None)
            if callable(mark):
                from enginehooks.control._futures import spawn
                from enginehooks.vllm_ext.handles import TORN

                update = self._updates
                spawn(lambda: update == self._updates and mark(TORN),
                      name=f"enginehooks-torn-{self.name}")
            raise _refused(self.name, "update_weights", e) from e
        self._version = version
        return [{"version": version} for _ in range(self.workers)]

    def flush_cache(self, timeout_s: float, auth: str | None = None) -> None:
        self.client.finish_weight_update(weight_version=self._version)
        self._in_session = False
        # what the new weights make stale: cached prefixes and cached encoder outputs
        # (vision embeddings), where the client can reset them (vllm_ext.handles)
        for cache in ("reset_prefix_cache", "reset_encoder_cache"):
            reset = getattr(self.client, cache, None)
            if callable(reset):
                reset()

    def version(self, timeout_s: float = 30.0) -> int | str | None:
        """The version of the last update this replica finished (as vLLM records it)."""
        return self._version


class EnginehooksTrainerWeightTransferEngine(
    TrainerWeightTransferEngine[EnginehooksTrainerInitInfo]
):
    """vLLM trainer-side engine of backend "enginehooks"; see the module docstring.

    `trainer_init` forms the transport group with the workers (vLLM's rendezvous);
    `send_weights(weight_version=None)` pushes the source once and returns the report.
    Without a `weight_version`, pushes are numbered 1, 2, ... by this engine; either way
    the version is what the workers record and what vLLM's `weight_info` then shows.
    Every trainer rank calls both; only rank 0 sends, the others iterate the source
    (their part of its collectives), as with vLLM's own backends.
    """

    init_info_cls = EnginehooksTrainerInitInfo

    def __init__(self, *, client: Any, source: WeightSource | None = None,
                 is_sender: bool = True, sync: WeightSync | None = None) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.sync = sync
        self.pushes = 0

    @classmethod
    def trainer_init(cls, init_info: EnginehooksTrainerInitInfo, *, client: Any,
                     source: WeightSource | None = None) -> EnginehooksTrainerWeightTransferEngine:
        if source is None:
            raise ConfigError("backend 'enginehooks' needs a WeightSource (e.g. ModuleSource(model))")
        if not init_info.is_sender:
            return cls(client=client, source=source, is_sender=False)
        sync = WeightSync(
            init_info.transport, host=init_info.host, port=init_info.port,
            bucket_bytes=init_info.bucket_bytes, timeout_s=init_info.timeout_s,
            checksum=init_info.checksum,
            dtype=torch_dtype(init_info.dtype) if init_info.dtype else None,
            device=init_info.device, transport_options=init_info.transport_options)
        name = init_info.name or getattr(client, "name", None) or "vllm"
        sync.add_replica(ClientReplica(client, init_info.world_size - 1, name=str(name),
                                       dtype=init_info.dtype, draft=init_info.draft))
        try:
            sync.connect()
        except BaseException:
            sync.close()
            raise
        return cls(client=client, source=source, is_sender=True, sync=sync)

    # vLLM's base returns None; the push's report is returned here for callers who want it.
    def send_weights(  # type: ignore[override]
            self, weight_version: int | str | None = None) -> PushReport | None:
        source = self.source
        if source is None:
            raise ConfigError("no WeightSource: build this engine with trainer_init")
        if not self.is_sender or self.sync is None:
            for _ in source:  # this rank's share of the source's collectives
                pass
            return None
        # Automatic numbering continues after the highest version pushed so far, explicit
        # ones included: a version never goes backwards silently.
        self.pushes += 1
        if weight_version is None:
            version: int | str = self.pushes
        else:
            version = weight_version
            numeric = _as_int(weight_version)
            if numeric is not None:
                self.pushes = max(self.pushes, numeric)
        return self.sync.push(WeightSourceAdapter(source), version=version)

    def shutdown(self) -> None:
        if self.sync is not None:
            self.sync.close()


def _as_int(v: int | str) -> int | None:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    text = str(v).strip()
    return int(text) if text.isdigit() else None


def _register() -> None:
    from enginehooks.vllm_ext.plugin import register

    register()


_register()  # a trainer process loads no vLLM plugin: importing this module registers
