"""One call at a time on an SGLang engine's RPC socket, however many handles wrap it.

Every `SGLangEngine` of one `sglang.Engine` speaks on the Engine's one ZMQ socket. Two
calls polling it at once take each other's replies: after a push failed, the trainer's
`leave` calls run on in the background while the caller asks the engine's state
through a new handle, and the reply the ask took left the leave waiting out its whole
timeout, holding its handle (the next push on it then hung for 120 s, seen in
`test_verify_every_update.py`).

The scheduler here is a scripted peer on a real ZMQ socket pair, speaking SGLang's own
encoding (`sock_send`/`sock_recv`): the test must hold one call's reply back while the
other is asked, which no real scheduler does on demand. What it checks is what the
peer saw: never two calls outstanding at once.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from enginehooks.sglang_ext.rpc import SchedulerRpc
from enginehooks.sglang_ext.scheduler import REPLY_TAG
from enginehooks_testkit.engines import sglang_path_here

sglang_path_here()  # SGLang's modules import here (conftest's `sgl_kernel` CPU stand-in)


def _reply(call_id: str, result: Any) -> str:
    return json.dumps({"tag": REPLY_TAG, "call_id": call_id,
                       "workers": [{"ok": True, "result": result}]})


@pytest.fixture
def sockets() -> Iterator[tuple[Any, Any]]:
    """(the client's socket, bound on loopback as an Engine binds it; the scripted
    scheduler's, connected to it)."""
    import zmq

    ctx = zmq.Context()
    client = ctx.socket(zmq.DEALER)
    port = client.bind_to_random_port("tcp://127.0.0.1")
    peer = ctx.socket(zmq.DEALER)
    peer.connect(f"tcp://127.0.0.1:{port}")
    try:
        yield client, peer
    finally:
        client.close(0)
        peer.close(0)
        ctx.term()


def test_two_handles_on_one_socket_never_have_two_calls_outstanding(
        sockets: tuple[Any, Any]) -> None:
    import zmq
    from sglang.srt.managers.io_struct import RpcReqOutput, sock_recv, sock_send

    client, peer = sockets
    outstanding, most = [0], [0]
    stop = threading.Event()

    def scheduler() -> None:
        # "slow" is answered 0.5 s after it arrives; what else arrives meanwhile is
        # counted as outstanding beside it (and answered at once)
        pending: list[tuple[float, str, Any]] = []
        while not stop.is_set():
            if peer.poll(10, zmq.POLLIN):
                req = sock_recv(peer)
                call_id = req.parameters["call_id"]
                outstanding[0] += 1
                most[0] = max(most[0], outstanding[0])
                delay = 0.5 if req.method == "slow" else 0.0
                pending.append((time.monotonic() + delay, call_id, req.method))
            for item in [p for p in pending if p[0] <= time.monotonic()]:
                pending.remove(item)
                outstanding[0] -= 1
                sock_send(peer, RpcReqOutput(success=True, message=_reply(item[1], item[2])))

    thread = threading.Thread(target=scheduler, daemon=True)
    thread.start()
    try:
        first, second = SchedulerRpc(client, "first"), SchedulerRpc(client, "second")
        got: dict[str, Any] = {}
        slow = threading.Thread(target=lambda: got.update(slow=first.call("slow", [], 10)))
        slow.start()
        time.sleep(0.1)  # the slow call is out, its reply held back
        got["info"] = second.call("info", [], 10)
        slow.join(10)
        assert got == {"slow": ["slow"], "info": ["info"]}  # each its own reply
        assert most[0] == 1, "a second call went out on the socket while one was outstanding"
    finally:
        stop.set()
        thread.join(5)


def test_a_timed_out_call_never_poisons_the_next(sockets: tuple[Any, Any]) -> None:
    """The reply of a call that gave up arrives later: the next call skips it by its id."""
    from sglang.srt.managers.io_struct import RpcReqOutput, sock_recv, sock_send

    from enginehooks.sglang_ext.rpc import RpcTimeout

    client, peer = sockets
    rpc = SchedulerRpc(client, "one")
    with pytest.raises(RpcTimeout, match="did not answer late within"):
        rpc.call("late", [], 0.2)
    late = sock_recv(peer)
    sock_send(peer, RpcReqOutput(success=True, message=_reply(late.parameters["call_id"], "late")))
    answered = threading.Thread(target=lambda: (
        (req := sock_recv(peer)),
        sock_send(peer, RpcReqOutput(success=True,
                                     message=_reply(req.parameters["call_id"], "next")))))
    answered.start()
    assert rpc.call("next", [], 5) == ["next"]
    answered.join(5)
