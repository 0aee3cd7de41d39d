"""What crosses between `RayEngine` and an actor's `EngineActorMixin`: an operation
name, JSON-able arguments and a timeout in; `{"result": ...}` or `{"error": kind,
"message": ...}` out. Errors travel as their class name and text, never as pickled
exception objects, and become the same enginehooks error on the trainer side."""

from __future__ import annotations

from typing import Any

from enginehooks.core import errors
from enginehooks.engine import protocol

#: Handle operations an actor runs for `RayEngine` (`EngineHandle` methods, plus the
#: vLLM handles' native-control readers, where the handle inside has them).
OPERATIONS: frozenset[str] = frozenset({
    "rpc", "info", "join", "leave", "check", "receive", "flush_cache", "pause", "resume",
    "digests", "version", "engine_version", "weight_checksums",
})

#: Every `EngineHooksError` subclass keeps its type across the actor boundary (restored
#: by `engine/protocol.py`, as on every channel); anything else becomes a `ReplicaError`
#: naming the actor, with the original class name in its text.


def error_reply(e: BaseException) -> dict[str, Any]:
    return {"error": type(e).__name__, "message": str(e)}


def raise_reply(reply: Any, who: str, op: str) -> Any:
    """The result of an actor's reply, or its error raised as enginehooks' own."""
    if isinstance(reply, dict) and "result" in reply:
        return reply["result"]
    if isinstance(reply, dict) and "error" in reply:
        kind, message = str(reply["error"]), str(reply.get("message", ""))
        if kind in protocol.error_classes() and kind != "ReplicaError":
            raise protocol.restore_error(kind, message, who)
        raise errors.ReplicaError(who, f"{op} failed in the actor: {kind}: {message}")
    raise errors.ReplicaError(who, f"{op}: the actor answered {reply!r}")
