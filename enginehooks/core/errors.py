"""Every error enginehooks raises derives from `EngineHooksError`.

Each names what went wrong in words a user can act on (the tensor, the replica, the
timeout), because the alternative in this field is a silent hang or a stale engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from enginehooks.core.report import PushReport


class EngineHooksError(RuntimeError):
    """Base class of all enginehooks errors.

    `report`: the push's report, when the error ended a `WeightSync.push`.
    `replica`: the replica the error came from, when one did.
    """

    report: PushReport | None = None
    replica: str | None = None


class ConfigError(EngineHooksError, ValueError):
    """An argument or option is invalid (raised before anything happens)."""


class ManifestError(EngineHooksError, ValueError):
    """A manifest is malformed, or does not match the model that should receive it."""


class TransportError(EngineHooksError):
    """The data plane failed: a peer left, a collective timed out, a checksum differed."""


class ChecksumError(TransportError):
    """A received bucket's bytes do not match the digest its sender computed."""


class PeerLost(TransportError):
    """Another party of the data plane went away mid-update (it closed or reset the
    connection, or the coordinator called the update off): a consequence of someone
    else's failure, never this side's own verdict. `WeightSync` ranks it last when it
    names the replica that caused a failed push."""


class SenderAborted(PeerLost):
    """The sender gave up in the middle of an update and told the receivers so."""


class TransferStalled(TransportError):
    """A data-plane wait (a collective, a bucket, an ack) ran out of time: a stalled
    peer stalls every receiver, so this points at a party that stopped sending."""


class PushTimeout(EngineHooksError, TimeoutError):
    """A replica, or the data plane, did not finish within the configured timeout."""


class ReplicaError(EngineHooksError):
    """A replica reported a failure; `replica` names it and the message carries its error."""

    def __init__(self, replica: str, message: str) -> None:
        super().__init__(f"replica {replica!r}: {message}")
        self.replica: str | None = replica


class ReplicaUnreachable(ReplicaError):
    """The replica's control endpoint could not be reached at all (connection refused,
    no route): no answer, rather than an answer that failed."""


class HTTPStatusError(ReplicaError):
    """A replica's HTTP server answered with an error status; `status` is the code (a
    handle tells a missing route, 404, from a refused token, 401, by it, never by the
    text)."""

    def __init__(self, replica: str, message: str, status: int = 0) -> None:
        super().__init__(replica, message)
        self.status = int(status)


class LayoutUnknown(EngineHooksError):
    """A push that named a prepared layout (`core/layout.py`) reached a worker that does
    not hold it (restarted, or it never checked it): nothing was changed there, and the
    trainer falls back to the full path (plan, check, transfer)."""


class ReplicaBusy(EngineHooksError):
    """The worker is applying another update; nothing was changed."""


class PluginError(EngineHooksError):
    """A plugin is missing, or two plugins registered the same name."""


class EngineTorn(EngineHooksError):
    """Generation refused: the engine is applying an update, or an update failed after
    data moved and it holds a mix of versions (policy `on_torn="refuse"`). `refusal`
    carries the details (state, failed version, reason)."""

    def __init__(self, refusal: dict[str, Any]) -> None:
        super().__init__(refusal["error"])
        self.refusal = refusal
