"""The built-in hook implementations: data-plane defaults and phase timing.

The defaults are `trylast`, so a plugin's own implementation of `send_weights`,
`receive_weights` or `update_group` (say, one that compresses, or that handles a
transport specially) runs first and wins by returning a result.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import torch

from enginehooks.plugins import get_transport, hookimpl

if TYPE_CHECKING:
    from enginehooks.manifest import Manifest
    from enginehooks.report import PushReport
    from enginehooks.transports.base import Abort, Receiver, Sender, SendStats, Stream, Target


@hookimpl(trylast=True)
def update_group(
    transport: str, action: str, side: str, endpoint: dict[str, Any] | None,
    member: Sender | Receiver | None, options: dict[str, Any],
) -> Sender | Receiver | None:
    if action == "leave":
        if member is not None:
            member.close()
        return member
    if action != "join":
        raise ValueError(f"update_group: unknown action {action!r} (join or leave)")
    t = get_transport(transport)
    if side == "sender":
        return t.sender(**options)
    assert endpoint is not None
    receiver = t.receiver(endpoint, int(options["rank"]), torch.device(options.get("device", "cpu")))
    receiver.connect()
    return receiver


@hookimpl(trylast=True)
def send_weights(
    transport: str, sender: Sender, manifest: Manifest, stream: Stream, abort: Abort
) -> SendStats:
    return sender.send(manifest, stream, abort)


@hookimpl(trylast=True)
def receive_weights(
    transport: str, receiver: Receiver, manifest: Manifest, target: Target
) -> dict[str, Any]:
    return receiver.deliver(manifest, target)


@hookimpl(trylast=True)
def run_phase(phase: str, report: PushReport, run: Callable[[], Any]) -> Any:
    return run()


@hookimpl(wrapper=True, specname="run_phase")
def time_phase(phase: str, report: PushReport, run: Callable[[], Any]) -> Generator:
    t0 = time.perf_counter()
    try:
        return (yield)
    finally:
        report.phases[phase] = report.phases.get(phase, 0.0) + time.perf_counter() - t0



def _plugins() -> list[Any]:
    import sys

    from enginehooks import trainer_side, transports

    return [sys.modules[__name__], transports, trainer_side]


#: Modules registered as plugins before entry points are loaded.
PLUGINS = _plugins()
