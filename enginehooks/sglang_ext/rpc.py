"""Calling `enginehooks_*` scheduler methods over SGLang's RPC socket, with a deadline.

`sglang.Engine.collective_rpc` blocks without a timeout and drops the method's result.
This client speaks the same protocol on the same ZMQ socket (`RpcReqInput` out,
`RpcReqOutput` back) but polls with a deadline, tags every call with an id, and reads
the JSON reply our `handle_rpc_request` hook puts into `RpcReqOutput.message`. A reply
that arrives after its caller gave up is recognised by its id and dropped, so one
timed-out call never poisons the next.

It runs in the process that binds the socket: the trainer's process for an in-process
`sglang.Engine` (the Engine binds it), the HTTP server's main process for
`launch_server` (our route binds it; see `plugin.py`). The socket carries SGLang's own
IPC encoding between SGLang's processes on one host; what leaves this module is JSON.

One call at a time per socket, however many clients wrap it: a ZMQ socket is not safe
for two threads, and two calls polling one socket take each other's replies (each
handle of one `sglang.Engine` wraps the same socket; after a failed push the trainer's
`leave` calls run on in the background while the caller asks the engine's state
through another handle: the reply one took from the other left that call waiting out
its whole timeout, and every later call on its handle behind it).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
import weakref
from typing import Any

from enginehooks.core.errors import PushTimeout, ReplicaError
from enginehooks.engine.contract import PREFIX
from enginehooks.sglang_ext.scheduler import REPLY_TAG


class RpcTimeout(PushTimeout):
    """The scheduler did not answer within the deadline."""


_LOCKS: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def socket_lock(socket: Any) -> threading.Lock:
    """The one lock of `socket`, shared by every client that wraps it."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(socket)
        if lock is None:
            lock = _LOCKS[socket] = threading.Lock()
        return lock


class SchedulerRpc:
    """One ZMQ DEALER socket to the scheduler(s), used by one call at a time (the
    socket's lock, `socket_lock`, whichever client holds it)."""

    def __init__(self, socket: Any, who: str = "sglang") -> None:
        self.socket = socket
        self.who = who
        self._lock = socket_lock(socket)

    def call(self, method: str, args: list[Any], timeout_s: float) -> list[Any]:
        """Run `method(*args)` on every TP rank; one JSON result per rank. Raises
        `ReplicaError` with the scheduler's error, `RpcTimeout` past the deadline."""
        import zmq
        from sglang.srt.managers.io_struct import RpcReqInput, RpcReqOutput, sock_recv, sock_send

        deadline = time.monotonic() + timeout_s
        call_id = uuid.uuid4().hex
        params = {"call_id": call_id, "args": json.dumps(args)}
        if not self._lock.acquire(timeout=max(0.0, timeout_s)):
            raise RpcTimeout(f"{self.who}: {method}: another call held the RPC socket for "
                             f"{timeout_s}s")
        try:
            sock_send(self.socket, RpcReqInput(method=method, parameters=params))
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not self.socket.poll(int(left * 1000) + 1, zmq.POLLIN):
                    raise RpcTimeout(
                        f"{self.who}: the scheduler did not answer {method} within "
                        f"{timeout_s}s (stopped, hung, or busy with a long update)")
                try:
                    out = sock_recv(self.socket, zmq.NOBLOCK)
                except zmq.Again:  # read by someone outside these clients meanwhile
                    continue
                if not isinstance(out, RpcReqOutput):
                    continue
                reply = _parse(out.message)
                if reply is None:
                    if not out.success and not _is_ours(out.message):
                        # An error that never reached our hook (e.g. the plugin is not
                        # loaded in the scheduler): say so, it is a setup problem.
                        raise ReplicaError(self.who, f"{method} failed in the scheduler: "
                                                     + missing_plugin_hint(out.message))
                    continue  # another caller's reply, or a stale one
                if reply.get("call_id") != call_id:
                    continue  # the answer to a call that already timed out
                return _results(self.who, method, reply)
        finally:
            self._lock.release()


def _is_ours(message: str) -> bool:
    return REPLY_TAG in (message or "")


def _parse(message: str) -> dict[str, Any] | None:
    if not message or not message.startswith("{"):
        return None
    try:
        reply = json.loads(message)
    except ValueError:
        return None
    return reply if isinstance(reply, dict) and reply.get("tag") == REPLY_TAG else None


def _results(who: str, method: str, reply: dict[str, Any]) -> list[Any]:
    workers = reply.get("workers") or []
    errors = [f"tp{i}: {w.get('error')}" for i, w in enumerate(workers) if not w.get("ok")]
    if errors:
        raise ReplicaError(who, f"{method} failed: " + "; ".join(errors))
    return [w.get("result") for w in workers]


def missing_plugin_hint(message: str) -> str:
    if f"has no attribute '{PREFIX}" in message:
        return (message + " (the enginehooks SGLang plugin is not loaded in the scheduler: is "
                "enginehooks installed in the engine's environment, and SGLANG_PLUGINS either "
                "unset or listing 'enginehooks'?)")
    return message
