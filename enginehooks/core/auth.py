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

import contextlib
import contextvars
import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from enginehooks.core.errors import EngineHooksError

SECRET_ENV = "ENGINEHOOKS_SECRET"
SECRET_FILE_ENV = "ENGINEHOOKS_SECRET_FILE"
#: A server's public name, the audience its tokens must name (default: an id the
#: server's workers share, fixed at start: `server_id`). Set it when several processes
#: serve one engine under one name and must agree on it.
SERVER_ID_ENV = "ENGINEHOOKS_SERVER_ID"
#: How far a token's timestamp may be from the engine's clock.
WINDOW_S = 300.0
log = logging.getLogger("enginehooks.auth")


class AuthError(EngineHooksError):
    """A control message or bucket was unsigned, wrongly signed, stale or replayed."""


_UNSET = object()
#: The secret of the engine worker whose join is running in this context (`secret_scope`)
_SCOPED: contextvars.ContextVar[Any] = contextvars.ContextVar("enginehooks_secret",
                                                               default=_UNSET)


@contextlib.contextmanager
def secret_scope(secret: bytes | None) -> Iterator[None]:
    """Within this block `load_secret()` answers `secret`: an engine worker read its
    secret once, at start (`EngineSide`), and the transport halves it opens (which call
    `load_secret()`) sign and verify with that one, whatever the environment says now."""
    token = _SCOPED.set(secret)
    try:
        yield
    finally:
        _SCOPED.reset(token)


def load_secret(env: dict[str, str] | None = None) -> bytes | None:
    """The shared secret from `ENGINEHOOKS_SECRET` or the file `ENGINEHOOKS_SECRET_FILE`
    (surrounding whitespace stripped), or None when neither is set; inside a
    `secret_scope`, that scope's secret."""
    if env is None:
        scoped = _SCOPED.get()
        if scoped is not _UNSET:
            return scoped if isinstance(scoped, bytes) else None
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


def configured_server_id(env: dict[str, str] | None = None) -> str | None:
    """`ENGINEHOOKS_SERVER_ID`, if set (stripped; at most 256 characters)."""
    value = (dict(os.environ if env is None else env).get(SERVER_ID_ENV) or "").strip()
    if len(value) > 256:
        raise AuthError(f"{SERVER_ID_ENV} is longer than 256 characters")
    return value or None


class NonceStore:
    """A replay window shared by every process of one server: one file per nonce seen,
    created exclusively (`O_EXCL`) in a private folder, so a token used at one API
    process is a replay at the others. Files older than the window are pruned."""

    def __init__(self, folder: str | Path, window_s: float = WINDOW_S) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.folder.stat().st_uid != os.getuid():
            raise AuthError(f"the nonce folder {self.folder} belongs to another user")
        self.window_s = window_s
        self._pruned = 0.0

    def first_use(self, nonce: str) -> bool:
        """Record `nonce`; False when any process of this server recorded it already."""
        if not nonce or len(nonce) > 128 or not all(c in "0123456789abcdef" for c in nonce):
            return False
        try:
            fd = os.open(self.folder / nonce, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return False
        os.close(fd)
        now = time.time()
        if now - self._pruned > self.window_s / 4:
            self._pruned = now
            for f in self.folder.iterdir():
                try:
                    if f.stat().st_mtime < now - 2 * self.window_s:
                        f.unlink()
                except OSError:
                    pass
        return True


class Verifier:
    """The engine side: checks tokens, remembers the nonces of the replay window."""

    def __init__(self, secret: bytes, window_s: float = WINDOW_S,
                 audience: str | Sequence[str] | None = None,
                 nonces: NonceStore | None = None) -> None:
        self.secret = secret
        self.window_s = window_s
        #: the ids this side answers to (a worker's own id, its server's id): a token
        #: must name one of them (None: any audience, for tools)
        self.audience = audience
        self.audiences: frozenset[str] | None = (
            None if audience is None
            else frozenset([audience] if isinstance(audience, str) else audience))
        #: a replay window shared with the server's other processes (None: this one's)
        self.nonces = nonces
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def verify(self, verb: str, payload: str, token: Any, anonymous_ok: bool = False) -> None:
        """Raise `AuthError` (and log it) unless `token` signs `verb` + `payload`, fresh
        and never seen before, for one of this side's names (`anonymous_ok`: or for
        nobody, where the signer cannot learn them)."""
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
        if (self.audiences is not None and not self.audiences.intersection(aud)
                and not (anonymous_ok and not aud)):
            mine = sorted(self.audiences)
            me = f"is {mine[0]!r}" if len(mine) == 1 else f"answers to {mine[:4]}"
            self._refuse(verb, "the authentication token was signed for another replica "
                               f"(audience {aud[:4]}, this worker {me})")
        if abs(time.time() - ts) > self.window_s:
            self._refuse(verb, f"the authentication token is {time.time() - ts:.0f}s old "
                               f"(window {self.window_s:.0f}s)")
        with self._lock:
            now = time.time()
            while self._seen and next(iter(self._seen.values())) < now - 2 * self.window_s:
                self._seen.popitem(last=False)
            if nonce in self._seen or (self.nonces is not None
                                       and not self.nonces.first_use(nonce)):
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
