"""What crosses between `RayEngine` and an actor's `EngineActorMixin`: an operation
name, JSON-able arguments and a timeout in; `{"result": ...}` or `{"error": kind,
"message": ...}` out. Errors travel as their class name and text, never as pickled
exception objects, and become the same enginehooks error on the trainer side."""

from __future__ import annotations

from typing import Any

from enginehooks.core import errors

#: Handle operations an actor runs for `RayEngine` (`EngineHandle` methods, plus the
#: vLLM handles' native-control readers, where the handle inside has them).
OPERATIONS: frozenset[str] = frozenset({
    "rpc", "info", "join", "leave", "check", "receive", "flush_cache", "pause", "resume",
    "digests", "version", "engine_version", "weight_checksums",
})

#: errors that keep their type across the actor boundary (anything else becomes a
#: `ReplicaError` naming the actor, with the original class name in its text)
KEPT: dict[str, type[errors.EngineHooksError]] = {
    cls.__name__: cls for cls in (
        errors.ConfigError, errors.ManifestError, errors.TransportError, errors.ChecksumError,
        errors.SenderAborted, errors.PushTimeout, errors.PluginError,
    )
}


def error_reply(e: BaseException) -> dict[str, Any]:
    return {"error": type(e).__name__, "message": str(e)}


def raise_reply(reply: Any, who: str, op: str) -> Any:
    """The result of an actor's reply, or its error raised as enginehooks' own."""
    if isinstance(reply, dict) and "result" in reply:
        return reply["result"]
    if isinstance(reply, dict) and "error" in reply:
        kind, message = str(reply["error"]), str(reply.get("message", ""))
        cls = KEPT.get(kind)
        if cls is not None:
            err = cls(message)
            err.replica = who
            raise err
        raise errors.ReplicaError(who, f"{op} failed in the actor: {kind}: {message}")
    raise errors.ReplicaError(who, f"{op}: the actor answered {reply!r}")
