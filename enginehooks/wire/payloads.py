"""What every verb's token signs, made and checked here only (a test scans the library
for it), so the trainer signs exactly what the worker verifies.

- **one signed payload per verb** (`signed_payload`), built here by both sides.
- **a `leave` names its group** (`leave_message` / `parse_leave`): a worker ignores a
  leave for a group it is no longer in (one delayed by the network past the next join).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from enginehooks.core.auth import Verifier, canonical, sign
from enginehooks.core.errors import ConfigError


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
