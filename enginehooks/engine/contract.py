"""The engine contract: the verbs every replica answers, and what an engine supplies.

A replica is reached through the engine's own RPC (vLLM `collective_rpc` to worker
methods, SGLang's scheduler RPC, a local call) under the method names
`enginehooks_<verb>`: vLLM asserts on names its worker already has, hence the prefix.
Arguments and results are JSON-able; over HTTP they may arrive as strings, so they
are decoded once, into the verb's typed request (`wire/`). Every engine
plugin exposes exactly `VERBS`, each forwarding to one `EngineSide` (`engine/side.py`)
with `dispatch`; what differs per engine is the `EngineBinding` it supplies: the
target that applies tensors, the expectations it derives from its own loader, its
dtype, and its engine-level controls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from enginehooks import wire
from enginehooks.core.errors import ConfigError

if TYPE_CHECKING:
    from enginehooks.engine.expectations import Expectations
    from enginehooks.transports.base import Target

PREFIX = "enginehooks_"

# Verbs that change state take a trailing `auth` token (JSON text, `core/auth.py`),
# required when the engine has a shared secret.
INFO = "info"          # -> {rank, version, state, group, transport, device, dtype, ...}
JOIN = "join"          # (endpoint JSON, rank offset[, auth]) -> {rank, transport, group}
LEAVE = "leave"        # ([leave message: {group, auth} JSON, or a bare token]) -> {left, group?}
CHECK = "check"        # (manifest JSON[, auth]) -> [problem, ...] (empty: the engine takes it)
RECEIVE = "receive"    # (manifest JSON, group[, auth]) -> stats of the applied update
DIGESTS = "digests"    # (names JSON) -> {name: {dtype, shape, crc32}} of readable weights
FLUSH = "flush"        # ([auth]) -> {flushed: bool | None} (None: the handle flushes instead)

VERBS: tuple[str, ...] = (INFO, JOIN, LEAVE, CHECK, RECEIVE, DIGESTS, FLUSH)


def method_name(verb: str) -> str:
    """The RPC method name of `verb` (`enginehooks_<verb>`)."""
    if verb not in VERBS:
        raise ConfigError(f"unknown engine verb {verb!r}; the contract has {VERBS}")
    return PREFIX + verb


def verb_of(method: str) -> str:
    """The verb of an RPC method name; a clear error for anything else."""
    verb = method.removeprefix(PREFIX)
    if not method.startswith(PREFIX) or verb not in VERBS:
        raise ConfigError(f"{method!r} is not an enginehooks method; the contract has "
                          f"{[PREFIX + v for v in VERBS]}")
    return verb


def dispatch(side: object, verb: str, args: tuple[Any, ...] | list[Any]) -> Any:
    """Run `verb` on `side` (an `EngineSide`, `engine/side.py`, which imports this
    module: typed `object` here so that no import circle runs back, not even for type
    checking) with `args` decoded into the verb's typed request (`wire.REQUESTS`): what
    every engine's RPC method does."""
    request = wire.REQUESTS[verb].from_args(args)
    return getattr(side, verb)(*request.values())


class EngineBinding(ABC):
    """What one engine worker supplies to its `EngineSide`.

    `engine` names the engine in `info`; `worker_rank` is this worker's index within
    its replica (vLLM's worker rank, SGLang's TP rank): the worker's rank in a
    transport group is the replica's offset plus it.
    """

    engine: ClassVar[str] = "engine"
    worker_rank: int = 0

    @abstractmethod
    def target(self) -> Target:
        """The object that applies tensors with the engine's own load path."""

    @abstractmethod
    def dtype(self) -> str:
        """The dtype the engine runs (floating tensors travel in it)."""

    @abstractmethod
    def expectations(self) -> Expectations:
        """What the engine's loader accepts, derived from the engine (see
        `engine/expectations.py`)."""

    def readable(self) -> Mapping[str, torch.Tensor]:
        """Parameters the engine keeps in checkpoint layout, by checkpoint name, for
        digests that move no tensor (embeddings, norms). Default: none."""
        return {}

    def after_update(self, version: int | str) -> dict[str, Any]:
        """Engine-level work once an update is applied (cache flush, version record);
        its JSON-able result joins the receive stats. Default: nothing."""
        return {}

    def flush(self) -> bool | None:
        """Flush cached prefixes from inside the worker; None when the engine's handle
        does it from outside (vLLM)."""
        return None

    def info(self) -> dict[str, Any]:
        """Extra engine facts for `info` (e.g. the engine's own weight version)."""
        return {}

    def deployment(self) -> str | None:
        """An id every worker of this engine deployment shares and no other deployment
        has, fixed at its start (vLLM's `instance_id`): an audience that tokens signed
        for the whole deployment name, where a trainer cannot learn each worker's id
        (vLLM's own weight-transfer calls). None: the engine has none."""
        return None

    def state_changed(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional
        """The worker's update state changed (`EngineSide.public_state()`): engines that
        refuse generation while torn outside this object (vLLM's front end) learn it
        here. Called with the state dict on every change."""
