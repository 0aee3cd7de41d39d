"""Errors keep their class from structure, never from their words (issue 36):
torch's exceptions get a class at the one boundary that reads them, `WeightSync` ranks a
failed push's outcomes by class, the HTTP client says a status and an unreachable host by
class, and vLLM's text-only channel carries the class in an envelope that text around it
cannot forge. Real gloo groups and a real HTTP server on loopback."""

from __future__ import annotations

import datetime
import http.server
import multiprocessing as mp
import os
import socket
import threading
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from enginehooks import wire
from enginehooks.control._http import request_json
from enginehooks.control.sync import CONSEQUENCE, NO_ANSWER, OWN, STALLED, blame
from enginehooks.core import errors
from enginehooks.core.auth import AuthError
from enginehooks.transports._rendezvous import master_store
from enginehooks.transports.base import data_plane_error


def _gloo(store: dist.Store, rank: int) -> dist.ProcessGroup:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=10)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(dist.PrefixStore("g", store), rank, 2, opts)


def _peer(port: int) -> None:  # a rank that takes one broadcast, then its process dies
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=10))
    pg = _gloo(store, 1)
    pg.broadcast(torch.zeros(4), 0).wait()
    os._exit(0)


def test_a_real_lost_gloo_peer_becomes_peer_lost() -> None:
    store = master_store("127.0.0.1", 0, 10.0)
    child = mp.get_context("spawn").Process(target=_peer, args=(store.port,))
    child.start()
    pg = _gloo(store, 0)
    pg.broadcast(torch.ones(4), 0).wait()
    child.join(30)
    with pytest.raises(RuntimeError) as raw:
        pg.broadcast(torch.ones(4), 0).wait()
    e = data_plane_error(raw.value, "receive of bucket 3")
    assert type(e) is errors.PeerLost and "receive of bucket 3 failed" in str(e)
    assert blame(e) == CONSEQUENCE


def test_a_store_wait_that_runs_out_becomes_transfer_stalled() -> None:
    store = master_store("127.0.0.1", 0, 1.0)
    with pytest.raises(RuntimeError) as raw:
        store.get("never-written")
    e = data_plane_error(raw.value, "bucket 0")
    assert type(e) is errors.TransferStalled and blame(e) == STALLED


def test_our_own_errors_pass_the_boundary_unchanged() -> None:
    own = errors.ChecksumError("bucket 2: digest differs")
    assert data_plane_error(own, "x") is own
    plain = data_plane_error(RuntimeError("CUDA error: an illegal memory access"), "copy")
    assert type(plain) is errors.TransportError and blame(plain) == OWN


def test_a_failed_push_is_ranked_by_class_never_by_words() -> None:
    """Before issue 36, a `TransportError` whose text said "closed by peer" (which anyone
    who reached a store could write into an abort key) counted as a consequence."""
    assert blame(errors.TransportError("Connection closed by peer; update aborted")) == OWN
    assert blame(errors.ReplicaError("r", "cannot reach http://x: timed out")) == OWN
    assert blame(errors.PeerLost("x")) == blame(errors.SenderAborted("x")) == CONSEQUENCE
    assert blame(errors.TransferStalled("x")) == STALLED
    assert blame(errors.ReplicaUnreachable("r", "x")) == blame(errors.PushTimeout("x")) \
        == blame(None) == NO_ANSWER


@pytest.fixture
def http_server() -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            status = 404 if self.path == "/missing" else 401
            body = b'{"detail": "HTTP 404 ConfigError AuthError"}'
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_the_http_client_says_status_and_reach_by_class(http_server: str) -> None:
    with pytest.raises(errors.HTTPStatusError) as e:
        request_json(f"{http_server}/missing", {}, timeout_s=10)
    assert e.value.status == 404
    with pytest.raises(errors.HTTPStatusError) as e:
        request_json(f"{http_server}/other", {}, timeout_s=10)
    assert e.value.status == 401  # whatever the body says
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with pytest.raises(errors.ReplicaUnreachable):
        request_json(f"http://127.0.0.1:{closed}/x", {}, timeout_s=10)


def test_a_relayed_error_keeps_its_class_and_words_around_it_cannot_forge_one() -> None:
    forged_inside = wire.relay_text(AuthError("replica refused: set ENGINEHOOKS_SECRET"))
    e = errors.TransportError(f"group called off by the sender: {forged_inside}")
    text = f"HTTP 500: Worker failed: {wire.relay_text(e)} (traceback follows)"
    kind, message = wire.relayed_envelope(text)  # type: ignore[misc]
    assert kind == "TransportError" and "called off" in message
    restored = wire.relayed_error(text, "vllm")
    assert type(restored) is errors.TransportError and restored.replica == "vllm"
    # the same class in process (vLLM's in-process executor re-raises the object)
    again = wire.relayed(errors.ManifestError("lm_head.weight: shape"))
    assert type(again) is errors.ManifestError and "lm_head.weight" in str(again)
    assert wire.relayed_envelope(str(again))[0] == "ManifestError"  # type: ignore[index]
    # no envelope, or a broken one: no class at all (the caller makes a ReplicaError)
    for plain in ("AuthError: no shared secret", wire.RELAY_MARK + "!!!]",
                  wire.RELAY_MARK + "e30=]"):
        assert wire.relayed_envelope(plain) is None


@pytest.mark.parametrize("cls", [errors.PeerLost, errors.TransferStalled,
                                 errors.ReplicaUnreachable, errors.SenderAborted])
def test_the_new_classes_survive_the_rpc_envelope(cls: type[errors.EngineHooksError]) -> None:
    e = cls("r", "gone") if issubclass(cls, errors.ReplicaError) else cls("gone")
    with pytest.raises(cls):
        wire.unwrap(wire.err("c1", e), "c1", "replica-a")


#: Built-in exceptions the library may raise, where and why: each is caught on the spot
#: and turned into a project error (the RPC decoders' ValueError becomes ConfigError in
#: `Request.from_args`; colocated's unreadable ready message and auth's malformed
#: audience are caught two lines below; the verifier's MemoryError is caught by its
#: callers and reported as "unverified"), marks a method a subclass must provide, says an
#: optional dependency is missing (ImportError, as Python does), or is a stand-in for a
#: third party's own module.
ALLOWED_BUILTIN_RAISES = {
    ("wire/requests.py", "ValueError"), ("transports/colocated.py", "ValueError"),
    ("core/auth.py", "TypeError"), ("transports/_rendezvous.py", "OSError"),
    ("ray_ext/actors.py", "NotImplementedError"), ("vllm_ext/handles.py", "NotImplementedError"),
    ("transports/cuda_ipc.py", "AssertionError"), ("control/identity.py", "AssertionError"),
    ("engine/verify.py", "MemoryError"), ("metrics/prometheus.py", "ImportError"),
    ("demo/sgl_kernel_stub/sgl_kernel/__init__.py", "RuntimeError"),
    ("demo/sgl_kernel_stub/sgl_kernel/__init__.py", "AttributeError"),
    # the stand-in's CPU ops refuse a shape the real kernel's TORCH_CHECK refuses
    ("demo/sgl_kernel_stub/sgl_kernel/_torch_ops.py", "ValueError"),
}


def test_the_library_raises_only_its_own_error_classes() -> None:
    """Issue 35: a caller catches `EngineHooksError` (or a subclass) for anything the
    library decides; built-in exceptions appear only where ALLOWED_BUILTIN_RAISES says."""
    import ast
    import builtins
    from pathlib import Path

    import enginehooks

    root = Path(enginehooks.__file__).parent
    found = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                name = exc.id if isinstance(exc, ast.Name) else None
                if name and isinstance(getattr(builtins, name, None), type):
                    found.add((path.relative_to(root).as_posix(), name))
    assert found <= ALLOWED_BUILTIN_RAISES, sorted(found - ALLOWED_BUILTIN_RAISES)
