"""enginehooks as a vLLM weight-transfer backend, worker side.

vLLM 0.32 ships a native RL API: a worker owns one `WeightTransferEngine`, chosen by
`weight_transfer_config={"backend": ...}` from `WeightTransferEngineFactory`, and
vLLM's own calls and routes drive it (`init_weight_transfer_engine`,
`start_weight_update`, `update_weights`, `finish_weight_update`). Registering this
class as backend "enginehooks" (`enginehooks.vllm_ext.plugin.register`, loaded from the
`vllm.general_plugins` entry point in every vLLM process) lets a vLLM user pick any
enginehooks transport without our worker extension, and keeps what enginehooks adds:
the manifest is checked against vLLM's own loader before any byte moves, buckets carry
digests, every wait has a timeout, and a failed update says it left the worker torn.

How vLLM's calls map onto the engine contract (`engine/contract.py`, `EngineSide`):

| vLLM call                         | here                                               |
| --------------------------------- | -------------------------------------------------- |
| `init_weight_transfer_engine`     | `join` the sender's group (`EnginehooksInitInfo`)   |
| `start_weight_update`             | open a session (nothing moves yet)                  |
| `start_draft_weight_update`       | the same, for the speculative draft model (its own  |
|                                   | binding: loader, check, verification; `retarget`)   |
| `update_weights` phase "check"    | `check`: raises `ManifestError` naming the problems |
| `update_weights` phase "receive"  | `receive`: check again, stream, apply, verify       |
| `finish_weight_update`            | close the session (vLLM then records the version)   |
| `shutdown_weight_transfer_engine` | `leave` the group                                   |

The check is a separate `update_weights` call because vLLM's calls return nothing: an
exception is the only answer a worker can give, and it must come before the trainer
enters the collective. Unlike vLLM's NCCL backend, `start_weight_update` does not begin
a layerwise reload: each "receive" runs vLLM's whole in-place reload itself
(`reload.inplace.reload_weights`, the path `LLM.reload_weights` takes), so a refused or
failed update never leaves a reload half-open between calls.

The worker's `EngineSide` is this engine's: the worker extension, when loaded too,
reports the same version and state (`WorkerExtension._enginehooks_side`).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from enginehooks.core.errors import ConfigError, EngineHooksError, ManifestError
from enginehooks.engine.side import EngineSide
from enginehooks.vllm_ext.worker_extension import ModelWorker, VLLMBinding
from enginehooks.wire import relayed

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

BACKEND = "enginehooks"
PHASES = ("check", "receive")
F = TypeVar("F", bound=Callable[..., Any])


def relays_errors(method: F) -> F:
    """vLLM's clients keep only an error's text: raise our errors with their class in
    that text (`wire.relay_text`), so the trainer restores the class from the
    envelope, never from the words (`transfer_trainer.ClientReplica`)."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except EngineHooksError as e:
            if getattr(e, "relayed", False):
                raise  # an inner method relayed it already
            raise relayed(e) from e

    return wrapper  # type: ignore[return-value]


@dataclass
class EnginehooksInitInfo(WeightTransferInitInfo):
    """What `init_weight_transfer_engine` carries: the sender's endpoint (the JSON a
    transport's `Sender.endpoint()` returns, with `world_size`) and the rank of this
    replica's first worker in that group (the sender is rank 0)."""

    endpoint: dict[str, Any] = field(default_factory=dict)
    rank_offset: int = 1
    auth: str | None = None  # the trainer's signature, required with a shared secret
    #: how many workers the trainer counts for this deployment (its `world_size` minus
    #: the sender): a count that differs from the deployment's is refused at once
    workers: int | None = None
    def __post_init__(self) -> None:
        if not isinstance(self.endpoint, dict) or "transport" not in self.endpoint:
            raise ConfigError("init_info.endpoint must be an enginehooks endpoint (a dict "
                              f"with 'transport', 'world_size', ...), got {self.endpoint!r}")
        if "world_size" not in self.endpoint:
            raise ConfigError("init_info.endpoint has no 'world_size'")
        if not isinstance(self.rank_offset, int) or self.rank_offset < 1:
            raise ConfigError(f"init_info.rank_offset must be an int >= 1 (rank 0 is the "
                              f"sender), got {self.rank_offset!r}")
        if self.workers is not None and (isinstance(self.workers, bool)
                                         or not isinstance(self.workers, int)):
            raise ConfigError(f"init_info.workers must be an int, got {self.workers!r}")


@dataclass
class EnginehooksUpdateInfo(WeightTransferUpdateInfo):
    """What one `update_weights` call carries: the manifest (JSON text) and the phase,
    "check" (validate only) or "receive" (take the update and apply it)."""

    manifest: str = ""
    phase: str = "receive"
    group: str = ""  # the group the trainer sends on (receive)
    auth: str | None = None  # the trainer's signature, required with a shared secret

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ConfigError(f"update_info.phase must be one of {PHASES}, got {self.phase!r}")
        if not isinstance(self.manifest, str) or not self.manifest:
            raise ConfigError("update_info.manifest must be the manifest's JSON text")


class EnginehooksWeightTransferEngine(
    WeightTransferEngine[EnginehooksInitInfo, EnginehooksUpdateInfo]
):
    """vLLM backend "enginehooks"; see the module docstring."""

    init_info_cls = EnginehooksInitInfo
    update_info_cls = EnginehooksUpdateInfo
    # A speculative draft model (vLLM's `start_draft_weight_update`) is updated through
    # its own binding: its own loader, manifest check and verification (`retarget`).
    supports_draft_weight_update = True

    def __init__(self, config: WeightTransferConfig, vllm_config: VllmConfig,
                 device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.worker = ModelWorker(vllm_config, device, model)
        self.side = EngineSide(VLLMBinding(self.worker))
        self.in_session = False
        self._drafts: dict[int, VLLMBinding] = {}

    def set_weight_update_target(self, model: torch.nn.Module, model_config: Any) -> None:
        """vLLM points a draft session at the speculative draft model: updates then land
        there, checked against and verified with the draft's own loader and config."""
        super().set_weight_update_target(model, model_config)
        if model is self.worker.get_model():
            self.side.retarget(None)
            return
        if id(model) not in self._drafts:
            config = copy.copy(self.vllm_config)
            config.model_config = model_config
            self._drafts[id(model)] = VLLMBinding(ModelWorker(config, self.device, model))
        self.side.retarget(self._drafts[id(model)])

    def reset_weight_update_target(self) -> None:
        super().reset_weight_update_target()
        self.side.retarget(None)

    @relays_errors
    def parse_init_info(self, init_dict: dict[str, Any]) -> EnginehooksInitInfo:
        try:
            return super().parse_init_info(init_dict)
        except ValueError as e:  # unknown keys: vLLM's wording, plus what is expected
            raise ConfigError(f"{e}; enginehooks expects {{'endpoint': {{...}}, "
                              f"'rank_offset': int}}") from None

    @relays_errors
    def parse_update_info(self, update_dict: dict[str, Any]) -> EnginehooksUpdateInfo:
        try:
            return super().parse_update_info(update_dict)
        except ValueError as e:
            raise ConfigError(f"{e}; enginehooks expects {{'manifest': JSON text, "
                              f"'phase': 'check' | 'receive'}}") from None

    @relays_errors
    def init_transfer_engine(self, init_info: EnginehooksInitInfo) -> None:
        with self.side.anonymous_audience():  # see `EngineSide.anonymous_audience`
            self.side.join(init_info.endpoint, init_info.rank_offset, init_info.auth,
                           replica_workers=self.worker.workers,
                           expected_workers=init_info.workers)

    def start_weight_update(self) -> None:
        self.in_session = True

    @relays_errors
    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base class synchronises the accelerator afterwards; our receivers
        # synchronise their own device work, and a CPU worker has no accelerator.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: EnginehooksUpdateInfo) -> None:
        if not self.in_session:
            raise ConfigError("update_weights outside a weight update: call "
                              "start_weight_update first")
        if update_info.phase == "check":
            with self.side.anonymous_audience():
                problems = self.side.check(update_info.manifest, update_info.auth)
            if problems:
                raise ManifestError("refused before any data moved: " + "; ".join(problems))
            return
        with self.side.anonymous_audience():
            self.side.receive(update_info.manifest, update_info.group or self.side.group or "",
                              update_info.auth)

    def finish_weight_update(self) -> None:
        self.in_session = False

    @relays_errors
    def shutdown(self) -> None:
        self.in_session = False
        self.side.leave()
