"""A module replica served over HTTP, for tests across hosts: the replica runs in its own
process (its own network namespace), the trainer reaches it across the network.

Server (`python -m tests.multihost.replica MODEL_DIR HOST PORT STATE_FILE`): a
`LocalEngine` around the tiny model in `MODEL_DIR`, so it receives through exactly the
code the engine plugins run (`EngineSide`, the transport receivers, the
`receive_weights` hook). `POST /rpc {"method", "args"}` answers `{"results": [...]}`,
or HTTP 500 with the worker's error; `GET /health`. Every state change of the worker
(`initial`, `updating`, `current`, `torn`, version) is written to `STATE_FILE`
(JSON, atomically): the test, on the machine's own network, reads it there.

Client: `RemoteModule(url)`, an `EngineHandle` whose `rpc` is that POST.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from enginehooks.control._http import request_json
from enginehooks.control.handles import EngineHandle
from enginehooks.engine.contract import verb_of
from enginehooks.engine.local import LocalEngine, _checkpoint_specs, _LocalBinding
from enginehooks.engine.side import EngineSide
from enginehooks.engine.targets import ModuleTarget
from tests.support.json_http import JsonHandler


class RemoteModule(EngineHandle):
    """The trainer's handle of a module replica served by this file's server."""

    def __init__(self, url: str, name: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.name = name or self.url

    def rpc(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        out = request_json(f"{self.url}/rpc", {"method": method, "args": [str(a) for a in args]},
                           timeout_s=timeout_s + 5.0, who=self.name)
        return list(out["results"])

    def flush_pending(self) -> bool:
        return False  # a bare module has no cache: no call to make

    def flush_cache(self, timeout_s: float, auth: str | None = None) -> None:
        """A bare module has no cache."""


class _Publishing(_LocalBinding):
    """The local binding, writing every state change to a file."""

    def __init__(self, target: ModuleTarget, specs: Any, path: Path) -> None:
        super().__init__(target, specs)
        self.path = path

    def state_changed(self, state: dict[str, Any]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.path)


def read_state(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    try:
        return json.loads(Path(path).read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


def serve(model_dir: str, host: str, port: int, state_file: str) -> None:
    from enginehooks_testkit.tiny import load_tiny

    model = load_tiny(model_dir)
    engine = LocalEngine(model, name="module-replica")
    engine.side = EngineSide(_Publishing(engine.target, _checkpoint_specs(model),
                                         Path(state_file)))

    class Handler(JsonHandler):
        def log_message(self, format: str, *args: Any) -> None:  # this harness keeps its log
            sys.stderr.write(f"[replica] {time.time():.3f} {format % args}\n")

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, {"ok": True})
            else:
                self._send(404, {"error": self.path})

        def do_POST(self) -> None:
            if self.path != "/rpc":
                self._send(404, {"error": self.path})
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            sys.stderr.write(f"[replica] {time.time():.3f} {body['method']} from "
                             f"{self.client_address[0]}\n")
            try:
                result = engine.side.call(verb_of(body["method"]), *body["args"])
            except Exception as e:
                self._send(500, {"error": f"{type(e).__name__}: {e}"})
                return
            # OSError: the trainer gave up on this call (a failed push)
            with contextlib.suppress(OSError):
                self._send(200, {"results": [result]})

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    print(json.dumps({"ready": f"http://{host}:{port}"}), flush=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sys.stdin.read()  # until the test closes our stdin (or kills us)
    server.shutdown()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
