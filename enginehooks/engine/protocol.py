"""The trainer<->worker protocol: what every verb signs, how every call is tagged, how
every answer (or error) travels back, and one deadline for a whole call.

Every channel (vLLM's `/collective_rpc` and `collective_rpc`, SGLang's scheduler RPC,
Ray actors, in-process replicas) carries the same messages:

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
- **one signed payload per verb**, built here by both sides (`signed_payload`): the
  trainer signs exactly what the worker verifies.
- **a `leave` names its group** (`leave_message` / `parse_leave`): a worker ignores a
  leave for a group it is no longer in (one delayed by the network past the next join).
- **a typed request per verb** (`JoinRequest`, `LeaveRequest`, `CheckRequest`,
  `ReceiveRequest`, `DigestsRequest`, `FlushRequest`, `InfoRequest`): the handle builds
  the RPC's arguments from one (`args()`), the worker decodes them into the same class
  (`from_args`, what `contract.dispatch` runs), and the token signs its `payload()`;
  typed replies (`WorkerInfo`, `JoinReply`, `LeaveReply`, `ReceiveReply`, `FlushReply`).
- **tokens are made and checked here** (`token`, `verify_token`, `verify_route`): no
  other module builds or parses a payload text or an envelope (a test scans for it).
- **`WorkerInfo`**: what `info` answers; `authenticated` is required.
- **`Deadline`**: one absolute deadline per call, read where the call waits (the
  package's one `core/deadline.py`, re-exported here).

Nothing here deserialises anything but JSON.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypedDict

from enginehooks.core import errors
from enginehooks.core.auth import AuthError, Verifier, canonical, sign
from enginehooks.core.deadline import Deadline as Deadline  # the one deadline, re-exported
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


# -- signed payloads --------------------------------------------------------------------
def signed_payload(verb: str, **fields: Any) -> str:
    """The exact text a verb's token signs (both sides build it here):
    join(endpoint, rank_offset), check(manifest), receive(manifest, group),
    leave(group), flush(). A leave that names no group (`group=None`: callers that
    cannot name one, such as vLLM's own `shutdown_weight_transfer_engine`) signs what
    a leave signed before groups were named."""
    if verb == "join":
        return canonical({"endpoint": fields["endpoint"], "rank_offset": fields["rank_offset"]})
    if verb == "check":
        return canonical(fields["manifest"])
    if verb == "receive":
        return canonical({"manifest": fields["manifest"], "group": fields["group"]})
    if verb == "leave" and fields.get("group") is not None:
        return canonical({"group": fields["group"]})
    if verb in ("leave", "flush"):
        return canonical("")
    raise ConfigError(f"verb {verb!r} is not signed")


def token(secret: bytes, verb: str, audience: Sequence[str] = (), **fields: Any) -> str:
    """The token of one control message: `verb`'s payload signed with `secret`, for the
    workers named by `audience` (their `info` instance ids; empty: any)."""
    return sign(secret, verb, signed_payload(verb, **fields), audience=audience)


def verify_token(verifier: Verifier, verb: str, auth: str | None, anonymous_ok: bool = False,
                 **fields: Any) -> None:
    """Raise `AuthError` unless `auth` signs `verb`'s payload (`signed_payload`) for this
    worker (`anonymous_ok`: or for nobody, see `EngineSide.anonymous_audience`)."""
    verifier.verify(verb, signed_payload(verb, **fields), auth, anonymous_ok)


# -- typed requests ----------------------------------------------------------------------
def _json_value(v: Any) -> Any:
    """A JSON argument that may arrive already decoded or as JSON text (HTTP)."""
    return json.loads(v) if isinstance(v, (str, bytes)) else v


def _text(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def _object(v: Any) -> dict[str, Any]:
    out = _json_value(v)
    if not isinstance(out, dict):
        raise ValueError(f"expected a JSON object, got {type(out).__name__}")
    return out


def _names(v: Any) -> list[str]:
    out = _json_value(v)
    if not isinstance(out, list) or not all(isinstance(n, str) for n in out):
        raise ValueError("expected a JSON list of tensor names")
    return out


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ValueError(f"expected an integer, got {type(v).__name__}")
    return int(v)


def _token(v: Any) -> str | None:
    return None if v in (None, "", "None", "null") else _text(v)


@dataclass(frozen=True)
class Request:
    """One verb's arguments. Fields in the order the RPC carries them (and the worker's
    `EngineSide` method takes them); the trailing `auth` (or a leave's message) is
    optional on the wire."""

    verb: ClassVar[str] = ""
    #: decoders of the wire arguments, in field order; `required` of them must be sent
    decoders: ClassVar[tuple[Callable[[Any], Any], ...]] = ()
    required: ClassVar[int] = 0

    def args(self) -> tuple[Any, ...]:
        """The RPC's arguments (JSON text for objects; an absent optional one left out)."""
        out = [json.dumps(v) if isinstance(v, (dict, list)) else v for v in self.values()]
        while len(out) > self.required and out[-1] is None:
            out.pop()
        return tuple(out)

    def values(self) -> list[Any]:
        return [getattr(self, f.name) for f in fields(self)]

    @classmethod
    def from_args(cls, args: Sequence[Any]) -> Request:
        """Decode an RPC's raw arguments (possibly JSON text); `ConfigError` otherwise."""
        if not cls.required <= len(args) <= len(cls.decoders):
            raise ConfigError(f"enginehooks_{cls.verb} takes {cls.required} to "
                              f"{len(cls.decoders)} arguments, got {len(args)}")
        try:
            decoded = [d(a) for d, a in zip(cls.decoders, args)]
        except (TypeError, ValueError) as e:  # arguments arrive as text from the network
            raise ConfigError(f"enginehooks_{cls.verb}: malformed argument "
                              f"({type(e).__name__}: {e})") from e
        return cls(*decoded)


@dataclass(frozen=True)
class InfoRequest(Request):
    verb: ClassVar[str] = "info"


@dataclass(frozen=True)
class JoinRequest(Request):
    """Join the sender's group (`endpoint`, with `world_size`) as ranks from `rank_offset`."""

    verb: ClassVar[str] = "join"
    decoders: ClassVar[tuple[Callable[[Any], Any], ...]] = (_object, _int, _token)
    required: ClassVar[int] = 2
    endpoint: dict[str, Any]
    rank_offset: int
    auth: str | None = None

    def payload(self) -> str:
        return signed_payload("join", endpoint=self.endpoint, rank_offset=self.rank_offset)


@dataclass(frozen=True)
class LeaveRequest(Request):
    """Leave a group: `message` is a `leave_message` (group and token) or a bare token."""

    verb: ClassVar[str] = "leave"
    decoders: ClassVar[tuple[Callable[[Any], Any], ...]] = (_token,)
    message: str | None = None


@dataclass(frozen=True)
class CheckRequest(Request):
    """Validate `manifest` (JSON text) against the engine's loader; nothing moves."""

    verb: ClassVar[str] = "check"
    decoders: ClassVar[tuple[Callable[[Any], Any], ...]] = (_text, _token)
    required: ClassVar[int] = 1
    manifest: str
    auth: str | None = None

    def payload(self) -> str:
        return signed_payload("check", manifest=self.manifest)


@dataclass(frozen=True)
class ReceiveRequest(Request):
    """Take and apply the update `manifest` from the sender of `group`."""

    verb: ClassVar[str] = "receive"
    decoders: ClassVar[tuple[Callable[[Any], Any], ...]] = (_text, _text, _token)
    required: ClassVar[int] = 2
    manifest: str
    group: str
    auth: str | None = None

    def payload(self) -> str:
        return signed_payload("receive", manifest=self.manifest, group=self.group)


@dataclass(frozen=True)
class DigestsRequest(Request):
    """crc32 of the named weights (read-only; capped by the worker)."""

    verb: ClassVar[str] = "digests"
    decoders: ClassVar[tuple[Callable[[Any], Any], ...]] = (_names,)
    required: ClassVar[int] = 1
    names: list[str]


@dataclass(frozen=True)
class FlushRequest(Request):
    verb: ClassVar[str] = "flush"
    decoders: ClassVar[tuple[Callable[[Any], Any], ...]] = (_token,)
    auth: str | None = None


#: verb -> its request class
REQUESTS: dict[str, type[Request]] = {c.verb: c for c in (
    InfoRequest, JoinRequest, LeaveRequest, CheckRequest, ReceiveRequest, DigestsRequest,
    FlushRequest)}


class JoinReply(TypedDict):
    rank: int
    transport: str
    group: str


class LeaveReply(TypedDict, total=False):
    left: bool
    group: str | None
    reason: str


class ReceiveReply(TypedDict, total=False):
    """One worker's stats of an applied update (transport stats plus these)."""

    seconds: float
    version: int | str
    flushed: bool


class FlushReply(TypedDict):
    flushed: bool | None


# -- join -------------------------------------------------------------------------------
WORLD_FIX = ("the group's world size is the sender plus every worker of every replica "
             "(vLLM's EnginehooksTrainerInitInfo(world_size=1 + workers); WeightSync counts "
             "them from each replica's info)")


def check_world(world_size: Any, rank_offset: int, worker_rank: int,
                replica_workers: int | None, expected_workers: int | None) -> None:
    """Refuse a join whose group cannot be formed, saying the fix: this worker's rank is
    outside the world size, or the trainer counts `expected_workers` for this replica
    where it runs `replica_workers` (either may be unknown: None)."""
    rank = rank_offset + worker_rank
    if world_size is not None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
            raise ConfigError(f"join refused: world_size {world_size!r} is not an int >= 2; "
                              f"{WORLD_FIX}")
        if rank >= world_size:
            raise ConfigError(f"join refused: this worker would be rank {rank} of a group of "
                              f"world_size {world_size}, which has room for ranks 1.."
                              f"{world_size - 1} only; {WORLD_FIX}")
    if (replica_workers is not None and expected_workers is not None
            and replica_workers != expected_workers):
        raise ConfigError(f"join refused: the trainer counts {expected_workers} worker(s) for "
                          f"this replica, which runs {replica_workers}: set world_size to "
                          f"{rank_offset + replica_workers} for one replica; {WORLD_FIX}")


# -- leave ------------------------------------------------------------------------------
def leave_message(group: str | None, auth: str | None) -> str | None:
    """The one argument of a `leave` (the contract's optional argument, where a bare
    token travelled before): JSON text naming the group the trainer leaves, with the
    token that signs it (`signed_payload("leave", group=...)`). A worker ignores a leave
    for a group it is no longer in: a leave sent while the link was down can be
    delivered by TCP after the next push's join. With no group to name, the bare token
    (or None)."""
    if group is None:
        return auth
    return json.dumps({"group": group, "auth": auth})


def parse_leave(arg: Any) -> tuple[str | None, str | None]:
    """(group, token) of a `leave`'s argument: a `leave_message`, or a bare token (or
    nothing) from callers that name no group, which leaves whatever group the worker is
    in. Malformed messages raise `ConfigError`."""
    if arg is None:
        return None, None
    text = arg.decode("utf-8", "replace") if isinstance(arg, bytes) else arg
    if not isinstance(text, str):
        text = json.dumps(text)
    try:
        data = json.loads(text)
    except ValueError:
        return None, text  # not JSON: a (bad) bare token, for the verifier to refuse
    if not isinstance(data, dict) or "group" not in data:
        return None, text  # a bare token
    group, auth = data["group"], data.get("auth")
    if not isinstance(group, str) or not group or len(group) > 4096:
        raise ConfigError(f"a leave names its group as a non-empty string, not {group!r:.200}")
    if isinstance(auth, dict):
        auth = json.dumps(auth)
    if auth is not None and not isinstance(auth, str):
        raise ConfigError(f"a leave's token is JSON text, not {type(auth).__name__}")
    return group, auth


# -- signed HTTP routes ------------------------------------------------------------------
#: The header that carries a token for an engine's control routes (vLLM's dev routes,
#: SGLang's admin routes, guarded by the enginehooks plugins when the engine has a secret).
ROUTE_AUTH_HEADER = "X-Enginehooks-Auth"
ROUTE_VERB = "route"
#: Where a server says who it is (`identity_answer`): the audience its route tokens
#: must name. Read-only, answered by the plugin itself, open to every client.
IDENTITY_ROUTE = "/enginehooks/identity"
_IDENTITY = "enginehooks-identity/1"


def route_payload(method: str, path: str, query: str, body: bytes) -> str:
    """What a control-route token signs: the method, the path and query, and the body's
    sha256. The server it is for is the token's audience (its identity, fixed at the
    server's start and learned from `IDENTITY_ROUTE`), never a header the client sends:
    a token captured on its way to one server is refused by every other."""
    import hashlib

    return canonical({"method": method.upper(), "path": path, "query": query,
                      "body": hashlib.sha256(body).hexdigest()})


def verify_route(verifier: Verifier, method: str, path: str, query: str, body: bytes,
                 auth: str | None) -> None:
    """Raise `AuthError` unless `auth` (the `ROUTE_AUTH_HEADER`) signs this request for
    this server (`verifier`'s audience is the server's identity)."""
    verifier.verify(ROUTE_VERB, route_payload(method, path, query, body), auth)


def route_headers(secret: bytes | str | None, url: str, body: Any,
                  server: str | None = None) -> dict[str, str]:
    """The header that signs a POST of JSON `body` to `url` for the server whose identity
    is `server` (`read_identity`; none without a secret)."""
    import urllib.parse

    if not secret:
        return {}
    key = secret.encode() if isinstance(secret, str) else secret
    u = urllib.parse.urlsplit(url)
    return {ROUTE_AUTH_HEADER: sign(key, ROUTE_VERB, route_payload(
        "POST", u.path, u.query, json.dumps(body).encode()),
        audience=[server] if server else ())}


def _identity_mac(secret: bytes | str, server: str, nonce: str) -> str:
    import hashlib
    import hmac

    key = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(key, f"{_IDENTITY}\n{server}\n{nonce}".encode(),
                    hashlib.sha256).hexdigest()


def identity_answer(secret: bytes | str | None, server: str, nonce: str) -> dict[str, Any]:
    """A server's answer to `GET IDENTITY_ROUTE?nonce=...`: its identity, with a MAC over
    it and the client's nonce (so a stranger cannot hand the client another identity)."""
    nonce = nonce[:128]
    return {"server": server, "nonce": nonce,
            "mac": _identity_mac(secret, server, nonce) if secret else None}


def read_identity(secret: bytes | str | None, answer: Any, nonce: str) -> str:
    """The identity in `answer` to the client's `nonce`; `AuthError` unless it is signed
    with `secret` (when the client has one) and answers this nonce."""
    import hmac

    if (not isinstance(answer, dict) or not isinstance(answer.get("server"), str)
            or not answer["server"] or answer.get("nonce") != nonce):
        raise AuthError(f"the server's identity answer is malformed or answers another "
                        f"request ({str(answer)[:200]})")
    if secret and answer.get("mac") is None:
        # the server says it has no secret: it checks no token, so the audience signed
        # for matters to nobody (and its workers refuse a signed push, saying the fix)
        return str(answer["server"])
    if secret and not (isinstance(answer.get("mac"), str) and hmac.compare_digest(
            answer["mac"], _identity_mac(secret, answer["server"], nonce))):
        raise AuthError("the server's identity is not signed with the shared secret: set the "
                        "same ENGINEHOOKS_SECRET on the server and the trainer")
    return str(answer["server"])


def server_verifier(secret: bytes, server: str) -> Verifier:
    """The route verifier of a server whose identity is `server`: tokens must name it,
    and the replay window is shared by every process that serves under that identity
    (a folder of used nonces), so a replay cannot hop between a server's API processes."""
    import getpass
    import hashlib
    import tempfile
    from pathlib import Path

    from enginehooks.core.auth import NonceStore

    tag = hashlib.sha256(f"{getpass.getuser()}\n{server}".encode()).hexdigest()[:24]
    folder = Path(tempfile.gettempdir()) / f"enginehooks-nonces-{tag}"
    return Verifier(secret, audience=server, nonces=NonceStore(folder))


# -- info -------------------------------------------------------------------------------
class WorkerInfo(TypedDict, total=False):
    """What `info` answers for one worker (`authenticated` and `instance` required)."""

    rank: int
    version: int | str | None
    state: str
    group: str | None
    authenticated: bool | None
    instance: str | None
    dtype: str
    param_dtypes: dict[str, str]
    wire_dtypes: dict[str, str]


def check_infos(infos: Sequence[Any], who: str, secret: bool) -> list[WorkerInfo]:
    """Validate a replica's `info` answers: a JSON object per worker that says whether it
    verifies signed updates. With a secret on the trainer, a worker that says it does
    not is refused (it would accept anyone's push)."""
    out: list[WorkerInfo] = []
    for i in infos:
        if not isinstance(i, dict) or "authenticated" not in i:
            raise ConfigError(f"replica {who!r}: a worker's info does not say whether it "
                              f"verifies signed updates ({str(i)[:200]}): run the same "
                              "enginehooks version on the trainer and the engines")
        out.append(i)  # type: ignore[arg-type]
    if secret and any(i.get("authenticated") is False for i in out):
        raise AuthError(
            f"replica {who!r} runs without the shared secret and would accept anyone's "
            "push: set ENGINEHOOKS_SECRET or ENGINEHOOKS_SECRET_FILE in its environment "
            "too (docs/security.md)")
    return out
