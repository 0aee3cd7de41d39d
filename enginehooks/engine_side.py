"""Engine-agnostic receiving state of one engine worker.

Engine plugins (vLLM worker extension, SGLang scheduler plugin) own one `EngineSide`
per worker and forward their RPCs to it; they supply only what differs per engine:
the `Target` that applies tensors, and the tensor names and shapes the model expects.
All arguments and results are JSON-able, since they cross engine RPC boundaries.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from enginehooks.errors import ManifestError, TransportError
from enginehooks.manifest import Manifest, TensorSpec
from enginehooks.plugins import get_plugin_manager
from enginehooks.transports.base import Receiver, Target


def validate(manifest: Manifest, expected: Mapping[str, TensorSpec], *,
             require_all: bool = True) -> list[str]:
    """Problems that make `manifest` unfit for a model expecting `expected`.

    Checked before any byte moves, so a refused update changes nothing. Every problem
    names the tensor.
    """
    problems = []
    for t in manifest.tensors:
        want = expected.get(t.name)
        if want is None:
            problems.append(f"unknown tensor {t.name!r}: the model has no such weight")
        elif tuple(want.shape) != tuple(t.shape):
            problems.append(
                f"tensor {t.name!r}: shape {list(t.shape)} but the model expects "
                f"{list(want.shape)}"
            )
        elif want.dtype != t.dtype:
            problems.append(
                f"tensor {t.name!r}: dtype {t.dtype} but the engine runs {want.dtype}"
            )
    if require_all:
        sent = {t.name for t in manifest.tensors}
        missing = sorted(n for n in expected if n not in sent)
        if missing:
            problems.append(
                f"{len(missing)} tensors of the model are missing from the update "
                f"(engines reload whole layers), first: {missing[:5]}"
            )
    return problems


class EngineSide:
    def __init__(
        self,
        target: Target,
        expected: Callable[[], Mapping[str, TensorSpec]],
        *,
        device: torch.device,
        worker_rank: int = 0,
    ) -> None:
        self.target = target
        self._expected_fn = expected
        self._expected: Mapping[str, TensorSpec] | None = None
        self.device = device
        self.worker_rank = worker_rank
        self.receiver: Receiver | None = None
        self.transport: str | None = None
        self.version: int | str | None = None
        self.state = "initial"  # initial | current | torn
        self.last_error: str | None = None

    def expected(self) -> Mapping[str, TensorSpec]:
        if self._expected is None:
            self._expected = dict(self._expected_fn())
        return self._expected

    # -- RPCs ---------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        return {
            "rank": self.worker_rank,
            "version": self.version,
            "state": self.state,
            "transport": self.transport,
            "device": str(self.device),
            "last_error": self.last_error,
        }

    def join(self, endpoint: str | dict[str, Any], rank: int) -> dict[str, Any]:
        ep = json.loads(endpoint) if isinstance(endpoint, str) else dict(endpoint)
        self.leave()
        pm = get_plugin_manager()
        self.receiver = pm.hook.update_group(
            transport=ep["transport"], action="join", side="receiver", endpoint=ep,
            member=None, options={"rank": rank, "device": str(self.device)},
        )
        self.transport = ep["transport"]
        return {"rank": rank, "transport": self.transport}

    def leave(self) -> None:
        if self.receiver is not None:
            get_plugin_manager().hook.update_group(
                transport=self.transport, action="leave", side="receiver", endpoint=None,
                member=self.receiver, options={},
            )
        self.receiver, self.transport = None, None

    def check(self, manifest: str | Manifest) -> list[str]:
        m = manifest if isinstance(manifest, Manifest) else Manifest.from_json(manifest)
        return validate(m, self.expected())

    def receive(self, manifest_json: str) -> dict[str, Any]:
        m = Manifest.from_json(manifest_json)
        problems = self.check(m)
        if problems:
            raise ManifestError("refused before any data moved: " + "; ".join(problems))
        if self.receiver is None:
            raise TransportError("this worker has not joined a transport group")
        t0 = time.perf_counter()
        try:
            stats = get_plugin_manager().hook.receive_weights(
                transport=self.transport, receiver=self.receiver, manifest=m, target=self.target
            )
        except BaseException as e:
            self.state, self.version = "torn", None
            self.last_error = f"update to {m.weight_version!r} failed: {type(e).__name__}: {e}"
            if self.receiver is not None and getattr(self.receiver, "broken", False):
                self.receiver, self.transport = None, None
            raise
        self.version, self.state, self.last_error = m.weight_version, "current", None
        stats = dict(stats or {})
        stats["seconds"] = time.perf_counter() - t0
        stats["version"] = m.weight_version
        return stats
