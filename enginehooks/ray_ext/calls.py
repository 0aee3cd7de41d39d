"""What crosses between `RayEngine` and an actor's `EngineActorMixin`: an operation
name, JSON-able arguments and a timeout in; `{"result": ...}` or `{"error": kind,
"message": ...}` out (`wire.result_reply` / `error_reply`, read by
`wire.read_reply`). Errors travel as their class name and text, never as pickled
exception objects, and become the same enginehooks error on the trainer side."""

from __future__ import annotations

from typing import Any

from enginehooks import wire

#: Handle operations an actor runs for `RayEngine` (`EngineHandle` methods, plus the
#: vLLM handles' native-control readers, where the handle inside has them).
OPERATIONS: frozenset[str] = frozenset({
    "rpc", "info", "join", "leave", "check", "receive", "flush_cache", "pause", "resume",
    "digests", "version", "engine_version", "weight_checksums",
})

#: Every `EngineHooksError` subclass keeps its type across the actor boundary (restored
#: by `wire/`, as on every channel); anything else becomes a `ReplicaError`
#: naming the actor, with the original class name in its text.


def error_reply(e: BaseException) -> dict[str, Any]:
    return wire.error_reply(e)


def raise_reply(reply: Any, who: str, op: str) -> Any:
    """The result of an actor's reply, or its error raised as enginehooks' own."""
    return wire.read_reply(reply, who, op)
