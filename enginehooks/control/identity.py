"""Who a server is: the audience of the route tokens a handle signs for it.

A token for an engine's control routes names the server it is for, so one captured on its
way to replica A is refused by replica B (issue 36; before, the audience was the `Host`
header, which the client chooses). The server's identity is fixed at its start (its
workers' deployment id, or `ENGINEHOOKS_SERVER_ID`) and answered, signed over the
client's nonce, at `wire.IDENTITY_ROUTE`. A handle learns it once, before its first
signed call, and again when a call is refused (HTTP 401) after the server restarted
under a new identity: then the call is sent once more, signed for the new one.
"""

from __future__ import annotations

import secrets
import threading
from typing import Any

from enginehooks.control._http import request_json
from enginehooks.core.errors import HTTPStatusError
from enginehooks.wire import IDENTITY_ROUTE, read_identity, route_headers


class ServerIdentity:
    """One server's identity as its handle knows it (see the module docstring)."""

    def __init__(self, url: str, who: str) -> None:
        self.url, self.who = url.rstrip("/"), who
        self.server: str | None = None
        self._known = False
        self._lock = threading.Lock()

    def _learn(self, secret: bytes | str, headers: dict[str, str],
               timeout_s: float) -> str | None:
        nonce = secrets.token_hex(16)
        try:
            answer = request_json(f"{self.url}{IDENTITY_ROUTE}?nonce={nonce}", None,
                                  timeout_s=timeout_s, who=self.who, headers=headers)
        except HTTPStatusError as e:
            if e.status == 404:
                return None  # no enginehooks guard on this server: nothing checks a token
            raise
        return read_identity(secret, answer, nonce)

    def get(self, secret: bytes | str, headers: dict[str, str],
            timeout_s: float) -> str | None:
        with self._lock:
            if not self._known:
                self.server, self._known = self._learn(secret, headers, timeout_s), True
            return self.server

    def refresh(self, secret: bytes | str, headers: dict[str, str], timeout_s: float) -> bool:
        """Learn the identity again; whether it changed (the server restarted)."""
        with self._lock:
            before = self.server
            self.server, self._known = self._learn(secret, headers, timeout_s), True
            return self.server != before

    def post(self, path: str, body: Any, *, secret: bytes | str | None,
             headers: dict[str, str], timeout_s: float) -> Any:
        """POST JSON `body` to `path`, signed for this server when there is a secret."""
        url = f"{self.url}{path}"
        for attempt in (0, 1):
            server = self.get(secret, headers, timeout_s) if secret else None
            signed = {**headers, **route_headers(secret, url, body, server)}
            try:
                return request_json(url, body, timeout_s=timeout_s, who=self.who,
                                    headers=signed)
            except HTTPStatusError as e:
                if (e.status == 401 and attempt == 0 and secret
                        and self.refresh(secret, headers, timeout_s)):
                    continue  # refused as another server's: signed again for this one
                raise
        raise AssertionError("unreachable")  # pragma: no cover
