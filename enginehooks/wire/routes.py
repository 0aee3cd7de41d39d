"""The signed HTTP control routes and a server's identity: what a route token signs
(method, path, query, body) and for whom (the server's identity, learned from its
`IDENTITY_ROUTE` with a MAC over the client's nonce).
"""

from __future__ import annotations

import json
from typing import Any

from enginehooks.core.auth import AuthError, Verifier, canonical, sign

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
        raise AuthError("the server's identity was refused: it is not signed with the shared "
                        "secret (the server runs with another one): set the same "
                        "ENGINEHOOKS_SECRET on the server and the trainer; nothing was sent")
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
