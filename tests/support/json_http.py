"""The HTTP handler base the test harnesses' worker processes answer JSON with (a module
replica, a TP engine worker): one place for the reply, quiet access logs."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from typing import Any


class JsonHandler(BaseHTTPRequestHandler):
    """`_send(code, body)` writes `body` as a JSON response; no access log."""

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, code: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
