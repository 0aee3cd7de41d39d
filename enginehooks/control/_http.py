"""A tiny JSON-over-HTTP client with a timeout on every call (standard library only).

Bodies are JSON in both directions; nothing is ever unpickled.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any

from enginehooks.core.errors import HTTPStatusError, PushTimeout, ReplicaUnreachable


def request_json(
    url: str, body: Any | None = None, *, timeout_s: float, method: str | None = None,
    who: str = "server", headers: dict[str, str] | None = None,
    response_headers: dict[str, str] | None = None,
) -> Any:
    """`headers` carries e.g. `Authorization: Bearer ...` for servers behind an API key;
    `response_headers`, when given, receives the answer's headers."""
    data = None if body is None else json.dumps(body).encode()
    all_headers = {"Content-Type": "application/json"} if data is not None else {}
    all_headers.update(headers or {})
    req = urllib.request.Request(
        url, data=data, method=method or ("POST" if data is not None else "GET"),
        headers=all_headers,
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw = resp.read()
            if response_headers is not None:
                response_headers.update({k.lower(): v for k, v in resp.headers.items()})
    except urllib.error.HTTPError as e:
        detail = e.read().decode("utf-8", "replace")[:2000]
        raise HTTPStatusError(who, f"{method or 'POST'} {url} -> HTTP {e.code}: {detail}",
                              status=e.code) from None
    except TimeoutError as e:
        raise PushTimeout(f"{who}: {url} did not answer within {timeout_s}s") from e
    except urllib.error.URLError as e:
        if isinstance(e.reason, (TimeoutError, socket.timeout)):
            raise PushTimeout(f"{who}: {url} did not answer within {timeout_s}s") from e
        raise ReplicaUnreachable(who, f"cannot reach {url}: {e.reason}") from None
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")
