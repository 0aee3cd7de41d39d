"""How every call is tagged and how every answer (or error) travels back.

- **a call id on every RPC.** The handle adds one argument, `enginehooks-call:<id>`, in
  front of the verb's own arguments; the worker answers with an envelope that echoes
  it. An answer with another call id is the late answer to an earlier call (vLLM keeps
  the answer of an RPC that timed out in its worker queue and hands it to the *next*
  caller) and is never taken as this call's answer.
- **an Ok/Err envelope.** `{"enginehooks": 1, "call": id, "ok": result}` or
  `{"enginehooks": 1, "call": id, "error": {"type": class name, "message": text}}`:
  errors travel as their class name and text (never pickled), and the trainer restores
  the same `EngineHooksError` subclass whatever the channel (a `ChecksumError` in a
  worker is a `ChecksumError` on the trainer, not a `ReplicaError`).
- **errors relayed as text** through channels that keep only an error's text (vLLM's own
  weight-transfer calls): the envelope rides, encoded, at the end of the text.

Nothing here deserialises anything but JSON.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from enginehooks.core import errors
from enginehooks.core.errors import ConfigError, EngineHooksError, ReplicaError

CALL_PREFIX = "enginehooks-call:"
VERSION = 1


class StaleReply(EngineHooksError):
    """An answer that belongs to another call (or carries no call id): discarded."""


# -- call ids ---------------------------------------------------------------------------
def new_call_id() -> str:
    return uuid.uuid4().hex


def call_arg(call_id: str) -> str:
    return CALL_PREFIX + call_id


def split_call(args: Sequence[Any]) -> tuple[str | None, tuple[Any, ...]]:
    """(call id or None, the verb's own arguments) of an RPC's raw arguments."""
    if args and isinstance(args[0], str) and args[0].startswith(CALL_PREFIX):
        call_id = args[0][len(CALL_PREFIX):]
        if not call_id or len(call_id) > 64 or not call_id.isalnum():
            raise ConfigError(f"malformed call id {args[0][:80]!r}")
        return call_id, tuple(args[1:])
    return None, tuple(args)


# -- envelopes --------------------------------------------------------------------------
def ok(call_id: str, result: Any) -> dict[str, Any]:
    return {"enginehooks": VERSION, "call": call_id, "ok": result}


def err(call_id: str, e: BaseException) -> dict[str, Any]:
    return {"enginehooks": VERSION, "call": call_id,
            "error": {"type": type(e).__name__, "message": str(e)[:20000]}}


def is_envelope(reply: Any) -> bool:
    return isinstance(reply, dict) and reply.get("enginehooks") == VERSION and "call" in reply


def answers(reply: Any, call_id: str) -> bool:
    """Whether `reply` is the envelope of call `call_id` (not a late one of another)."""
    return is_envelope(reply) and reply["call"] == call_id


# Channels where every call has its own answer path (Ray object refs) carry no call id:
# `{"result": ...}` or `{"error": class name, "message": text}`.
def result_reply(result: Any) -> dict[str, Any]:
    return {"result": result}


def error_reply(e: BaseException) -> dict[str, Any]:
    return {"error": type(e).__name__, "message": str(e)[:20000]}


def read_reply(reply: Any, who: str, op: str) -> Any:
    """The result of a `result_reply`, or the error of an `error_reply` raised as the
    same enginehooks class (anything else: a `ReplicaError` naming `who` and `op`)."""
    if isinstance(reply, dict) and "result" in reply:
        return reply["result"]
    if isinstance(reply, dict) and "error" in reply:
        kind, message = str(reply["error"]), str(reply.get("message", ""))
        if kind in error_classes() and kind != "ReplicaError":
            raise restore_error(kind, message, who)
        raise ReplicaError(who, f"{op} failed in the actor: {kind}: {message}")
    raise ReplicaError(who, f"{op}: the actor answered {reply!r:.300}")


def error_classes() -> dict[str, type[EngineHooksError]]:
    """Every `EngineHooksError` subclass by name (those imported so far; the ones the
    engine contract raises are imported with it)."""
    out: dict[str, type[EngineHooksError]] = {}
    todo: list[type[EngineHooksError]] = [EngineHooksError]
    while todo:
        cls = todo.pop()
        out.setdefault(cls.__name__, cls)
        todo.extend(cls.__subclasses__())
    return out


def restore_error(kind: str, message: str, who: str) -> EngineHooksError:
    """The enginehooks error `kind` (a class name) with `message`, from replica `who`;
    anything else (an engine's own exception) becomes a `ReplicaError` naming it."""
    cls = error_classes().get(kind)
    e: EngineHooksError
    if cls is None or cls is ReplicaError:
        e = ReplicaError(who, message if cls is ReplicaError else f"{kind}: {message}")
    elif issubclass(cls, ReplicaError) and cls is not errors.HTTPStatusError:
        e = cls(who, message)
    elif cls is errors.EngineTorn:
        e = errors.EngineTorn({"error": message, "state": "torn"})
    else:
        try:
            e = cls(message)
        except TypeError:  # a subclass with another constructor
            e = ReplicaError(who, f"{kind}: {message}")
    e.replica = who
    return e


def unwrap(reply: Any, call_id: str, who: str) -> Any:
    """The result carried by `reply` for call `call_id`; its error raised as the same
    class; `StaleReply` when it answers another call."""
    if not is_envelope(reply):
        raise StaleReply(f"{who}: an answer without a call id ({str(reply)[:200]})")
    if reply["call"] != call_id:
        raise StaleReply(f"{who}: the answer to call {reply['call']!r}, not {call_id!r}")
    if "error" in reply:
        e = reply["error"] if isinstance(reply["error"], dict) else {}
        raise restore_error(str(e.get("type", "ReplicaError")), str(e.get("message", "")), who)
    return reply.get("ok")


# -- errors relayed as text ------------------------------------------------------------
# vLLM's own weight-transfer calls (`init_weight_transfer_engine`, `update_weights`)
# answer nothing and its clients keep only an error's text. So a worker of backend
# "enginehooks" raises a `RelayedError` whose text ends with the error envelope, encoded
# so that no quoting on the way (JSON bodies, reprs, Ray's tracebacks) can alter it, and
# the trainer restores the class from that field, never from the words around it. The
# genuine envelope is always the last one: any marker inside the message (an attacker's
# text quoted by a worker error) comes before it and is never read.
RELAY_MARK = "[enginehooks-error:"


class RelayedError(EngineHooksError):
    """A worker's error raised through a channel that keeps only text; its message ends
    with the envelope (`relay_text`) that `relayed_error` reads back."""


def relay_text(e: BaseException) -> str:
    """`e` as text that carries its class: readable words, then the encoded envelope."""
    import base64

    kind = type(e).__name__
    message = str(e)[:20000]
    field = base64.urlsafe_b64encode(json.dumps(
        {"enginehooks": VERSION, "type": kind, "message": message}).encode()).decode()
    return f"{kind}: {message} {RELAY_MARK}{field}]"


def relayed(e: EngineHooksError) -> EngineHooksError:
    """`e` again, of the same class where its constructor takes a message (so in-process
    callers still catch it by class), its text now `relay_text(e)`."""
    text = relay_text(e)
    out: EngineHooksError
    try:
        out = ReplicaError(e.replica or "worker", text) if isinstance(e, ReplicaError) \
            else type(e)(text)
    except TypeError:
        out = RelayedError(text)
    if type(out) is not type(e):
        out = RelayedError(text)
    out.relayed = True  # type: ignore[attr-defined]
    return out


def relayed_envelope(text: str) -> tuple[str, str] | None:
    """(class name, message) of the last relay envelope in `text`, or None when it
    carries none (the error did not come from an enginehooks worker)."""
    import base64
    import binascii

    at = text.rfind(RELAY_MARK)
    if at < 0:
        return None
    field = text[at + len(RELAY_MARK):]
    end = field.find("]")
    if end < 0:
        return None
    try:
        data = json.loads(base64.urlsafe_b64decode(field[:end].encode()))
    except (ValueError, binascii.Error):
        return None
    if (not isinstance(data, dict) or data.get("enginehooks") != VERSION
            or not isinstance(data.get("type"), str) or not isinstance(data.get("message"), str)):
        return None
    return data["type"], data["message"]


def relayed_error(text: str, who: str) -> EngineHooksError | None:
    """The worker error whose envelope `text` carries, as its own class (`restore_error`);
    None when `text` carries none."""
    found = relayed_envelope(text)
    if found is None:
        return None
    return restore_error(found[0], found[1], who)
