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

from enginehooks.markers import hookimpl
from enginehooks.plugins import get_transport
from enginehooks.transports.base import JoinSender, LeaveReceiver, LeaveSender

if TYPE_CHECKING:
    from enginehooks.core.manifest import Manifest
    from enginehooks.core.report import PushReport
    from enginehooks.transports.base import (
        Abort,
        GroupResult,
        GroupUpdate,
        Receiver,
        Sender,
        SendStats,
        Stream,
        Target,
    )


@hookimpl(trylast=True)
def update_group(request: GroupUpdate) -> GroupResult:
    if isinstance(request, LeaveSender):
        request.sender.close()
        return request.sender
    if isinstance(request, LeaveReceiver):
        request.receiver.close()
        return request.receiver
    transport = get_transport(request.transport)
    if isinstance(request, JoinSender):
        return transport.sender(**request.options)
    receiver = transport.receiver(dict(request.endpoint), request.rank,
                                  torch.device(request.device))
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


