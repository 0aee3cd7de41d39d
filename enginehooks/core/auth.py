"""Authenticated updates: a shared secret, an HMAC on every control message, keyed buckets.

Without a secret, anyone who can reach an engine's RPC route or a rendezvous port can
push weights. With one configured on the trainer and the engines (the environment
variable `ENGINEHOOKS_SECRET`, or a file named by `ENGINEHOOKS_SECRET_FILE`; never a
command-line argument, which other users of the host can read), then:

- every state-changing control message (join, check, receive, leave, flush) carries a
  token: an HMAC-SHA256 over the verb, a fresh nonce, a timestamp and the message's
  payload (the endpoint, the manifest). The engine verifies it before acting; unsigned,
  wrongly signed, stale (outside `WINDOW_S`) and replayed (nonce seen) messages are
  refused, logged, and change nothing;
- every bucket's trailer carries a 128-bit HMAC of its update id, index, size and
  digest, so bytes fed into a group by a process that merely reached the store are
  refused (`ChecksumError`) before they are applied. With a host digest (xxh3/crc32) or
  none, this authenticates the metadata and a digest that is cheap to collide for an
  attacker only if it is `sum64`: docs/security.md says what each combination protects.

The payloads are JSON text signed as sent; nothing here deserialises untrusted bytes
beyond `json.loads`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from enginehooks.core.errors import EngineHooksError

SECRET_ENV = "ENGINEHOOKS_SECRET"
SECRET_FILE_ENV = "ENGINEHOOKS_SECRET_FILE"
#: How far a token's timestamp may be from the engine's clock.
WINDOW_S = 300.0
log = logging.getLogger("enginehooks.auth")


class AuthError(EngineHooksError):
    """A control message or bucket was unsigned, wrongly signed, stale or replayed."""


def load_secret(env: dict[str, str] | None = None) -> bytes | None:
    """The shared secret from `ENGINEHOOKS_SECRET` or the file `ENGINEHOOKS_SECRET_FILE`
    (surrounding whitespace stripped), or None when neither is set."""
    env = dict(os.environ if env is None else env)
    value = env.get(SECRET_ENV)
    if value:
        return value.strip().encode()
    path = env.get(SECRET_FILE_ENV)
    if path:
        try:
            text = Path(path).read_text().strip()
        except OSError as e:
            raise AuthError(f"{SECRET_FILE_ENV}={path}: cannot read the secret: {e}") from e
        if not text:
            raise AuthError(f"{SECRET_FILE_ENV}={path} is empty")
        return text.encode()
    return None


def canonical(value: Any) -> str:
    """The text a token signs for `value` (JSON text or a JSON-able object): the same on
    both sides whatever key order or spacing the message travelled with."""
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError:
            return value.decode() if isinstance(value, bytes) else value
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _mac(secret: bytes, verb: str, nonce: str, ts: float, payload: str,
         audience: list[str]) -> str:
    aud = json.dumps(audience)
    msg = f"enginehooks/2\n{verb}\n{nonce}\n{ts!r}\n{aud}\n{payload}".encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def sign(secret: bytes, verb: str, payload: str, audience: Sequence[str] = (),
         ts: float | None = None) -> str:
    """The token (JSON text) for sending `verb` with `payload` to the workers named in
    `audience` (their `instance` ids, from `info`): a worker refuses a token whose
    audience does not name it, so a message signed for replica A is refused by B.
    `ts` defaults to now (tests sign old tokens with it)."""
    nonce, ts = secrets.token_hex(16), time.time() if ts is None else float(ts)
    aud = sorted(str(a) for a in audience)
    return json.dumps({"nonce": nonce, "ts": ts, "aud": aud,
                       "mac": _mac(secret, verb, nonce, ts, payload, aud)})


class Verifier:
    """The engine side: checks tokens, remembers the nonces of the replay window."""

    def __init__(self, secret: bytes, window_s: float = WINDOW_S,
                 audience: str | None = None) -> None:
        self.secret = secret
        self.window_s = window_s
        #: this worker's id: tokens must name it (None: any audience, for tools)
        self.audience = audience
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def verify(self, verb: str, payload: str, token: Any) -> None:
        """Raise `AuthError` (and log it) unless `token` signs `verb` + `payload`, fresh
        and never seen before."""
        try:
            data = json.loads(token) if isinstance(token, str) else token
            nonce, ts, mac = str(data["nonce"]), float(data["ts"]), str(data["mac"])
            aud = data.get("aud", [])
            if not isinstance(aud, list) or len(aud) > 4096:
                raise TypeError("aud")
            aud = [str(a) for a in aud]
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            self._refuse(verb, f"no valid authentication token ({type(e).__name__})")
        if not hmac.compare_digest(mac, _mac(self.secret, verb, nonce, ts, payload, aud)):
            self._refuse(verb, "the authentication token does not match (wrong secret or "
                               "altered message)")
        # An empty audience: signed by a trainer that cannot ask the workers for their
        # ids (vLLM's own weight-transfer calls); docs/security.md says what that leaves.
        if self.audience is not None and aud and self.audience not in aud:
            self._refuse(verb, "the authentication token was signed for another replica "
                               f"(audience {aud[:4]}, this worker is {self.audience!r})")
        if abs(time.time() - ts) > self.window_s:
            self._refuse(verb, f"the authentication token is {time.time() - ts:.0f}s old "
                               f"(window {self.window_s:.0f}s)")
        with self._lock:
            now = time.time()
            while self._seen and next(iter(self._seen.values())) < now - 2 * self.window_s:
                self._seen.popitem(last=False)
            if nonce in self._seen:
                self._refuse(verb, "the authentication token was already used (replay)")
            self._seen[nonce] = now

    @staticmethod
    def _refuse(verb: str, why: str) -> NoReturn:
        log.warning("enginehooks: refused an unauthenticated %s: %s", verb, why)
        raise AuthError(f"{verb} refused: {why}")


def bucket_mac(secret: bytes, mid: int, index: int, nbytes: int, dig: int) -> tuple[int, int]:
    """128 bits of HMAC over a bucket's identity and digest, as two signed int64 (the
    trailer's last two fields)."""
    msg = f"enginehooks-bucket/1 {mid} {index} {nbytes} {dig}".encode()
    d = hmac.new(secret, msg, hashlib.sha256).digest()
    return (int.from_bytes(d[:8], "little", signed=True),
            int.from_bytes(d[8:16], "little", signed=True))
