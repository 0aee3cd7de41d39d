"""Engine-agnostic receiving state of one engine worker: the verbs of the contract.

Engine plugins (vLLM worker extension, SGLang scheduler plugin, `LocalEngine`) own one
`EngineSide` per worker and route every `enginehooks_*` RPC to it through
`contract.dispatch`; they supply only an `EngineBinding`. All arguments and results
are JSON-able, since they cross engine RPC boundaries.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable
from typing import Any

import torch

from enginehooks.core.dtypes import dtype_name
from enginehooks.core.errors import ManifestError, TransportError
from enginehooks.core.manifest import Manifest
from enginehooks.engine.contract import EngineBinding, dispatch
from enginehooks.engine.expectations import Expectations
from enginehooks.plugins import get_plugin_manager
from enginehooks.transports.base import GroupRequest, Receiver


class EngineSide:
    """One worker's group membership, validation, version and state.

    `state` is "initial" (serving the weights it started with), "current" (the last
    update succeeded) or "torn" (an update failed after data moved: the engine holds a
    mix of versions until the next push succeeds).
    """

    def __init__(self, binding: EngineBinding) -> None:
        self.binding = binding
        self.target = binding.target()
        self.device: torch.device = self.target.device
        self.worker_rank = binding.worker_rank
        self._expectations: Expectations | None = None
        self.receiver: Receiver | None = None
        self.transport: str | None = None
        self.version: int | str | None = None
        self.state = "initial"
        self.last_error: str | None = None

    def call(self, verb: str, *args: Any) -> Any:
        """Run a contract verb with raw (possibly JSON-text) arguments."""
        return dispatch(self, verb, args)

    def expectations(self) -> Expectations:
        if self._expectations is None:
            self._expectations = self.binding.expectations()
        return self._expectations

    # -- the verbs ----------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        dtype = self.binding.dtype()
        return {
            "rank": self.worker_rank,
            "version": self.version,
            "state": self.state,
            "transport": self.transport,
            "device": str(self.device),
            "last_error": self.last_error,
            "dtype": dtype,
            # tensors the engine's loader puts in parameters of another dtype
            "wire_dtypes": {n: d for n, d in self.expectations().wire_dtypes().items()
                            if d != dtype},
            "engine": self.binding.engine,
            **self.binding.info(),
        }

    def join(self, endpoint: dict[str, Any], rank_offset: int) -> dict[str, Any]:
        """Join the group described by `endpoint` as rank `rank_offset + worker_rank`."""
        self.expectations()  # derive them now, before an update could move the model
        self.leave()
        rank = rank_offset + self.worker_rank
        transport = str(endpoint["transport"])
        self.receiver = get_plugin_manager().hook.update_group(request=GroupRequest.join_receiver(
            transport, endpoint, rank, str(self.device)))
        self.transport = transport
        return {"rank": rank, "transport": transport}

    def leave(self) -> dict[str, Any]:
        if self.receiver is not None and self.transport is not None:
            get_plugin_manager().hook.update_group(request=GroupRequest.leave(
                self.transport, "receiver", self.receiver))
        self.receiver, self.transport = None, None
        return {"left": True}

    def check(self, manifest_json: str) -> list[str]:
        return self._problems(Manifest.from_json(manifest_json))

    def _problems(self, manifest: Manifest) -> list[str]:
        return self.expectations().problems(manifest.specs())

    def receive(self, manifest_json: str) -> dict[str, Any]:
        m = Manifest.from_json(manifest_json)
        problems = self._problems(m)
        if problems:
            raise ManifestError("refused before any data moved: " + "; ".join(problems))
        receiver = self.receiver
        if receiver is None or self.transport is None:
            raise TransportError("this worker has not joined a transport group")
        t0 = time.perf_counter()
        try:
            stats = get_plugin_manager().hook.receive_weights(
                transport=self.transport, receiver=receiver, manifest=m, target=self.target)
        except BaseException as e:
            self.state, self.version = "torn", None
            self.last_error = f"update to {m.weight_version!r} failed: {type(e).__name__}: {e}"
            if receiver.broken:
                self.receiver, self.transport = None, None
            raise
        self.version, self.state, self.last_error = m.weight_version, "current", None
        stats = dict(stats or {})
        stats["seconds"] = time.perf_counter() - t0
        stats["version"] = m.weight_version
        stats.update(self.binding.after_update(m.weight_version))
        return stats

    def digests(self, names: Iterable[str]) -> dict[str, Any]:
        """crc32 of weights the engine keeps in checkpoint layout (embeddings, norms;
        fused or prepacked ones are skipped), for bit-exact checks that move no tensor.
        A vocabulary padded by the engine is compared on the checkpoint's rows."""
        params, expect = self.binding.readable(), self.expectations()
        out: dict[str, Any] = {}
        for name in names:
            p, spec = params.get(name), expect.checkpoint_spec(name)
            if p is None or spec is None or p.dim() != len(spec.shape):
                continue
            if tuple(p.shape[1:]) != tuple(spec.shape[1:]) or p.shape[0] < spec.shape[0]:
                continue
            data = p.detach()[: spec.shape[0]].contiguous().cpu()
            out[name] = {"dtype": dtype_name(data.dtype), "shape": list(data.shape),
                         "crc32": zlib.crc32(data.reshape(-1).view(torch.uint8).numpy())}
        return out

    def flush(self) -> dict[str, Any]:
        return {"flushed": self.binding.flush()}
