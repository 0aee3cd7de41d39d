"""Every hook enginehooks calls, in one place.

Plugins implement these with `@enginehooks.hookimpl` and ship on the `enginehooks`
entry-point group; built-in transports, trainer adapters and timing are plugins too
(see `enginehooks.plugins`). `docs/hooks.md` documents each hook, and a test fails
when a hook here lacks a section there or a test that calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from enginehooks.markers import hookspec

if TYPE_CHECKING:
    from enginehooks.core.manifest import Manifest
    from enginehooks.core.report import PushReport
    from enginehooks.trainer_side.contract import TrainerAdapter
    from enginehooks.transports.base import (
        Abort,
        GroupResult,
        GroupUpdate,
        Receiver,
        Sender,
        SendStats,
        Stream,
        Target,
        Transport,
    )

# -- registries: plugins add named things through a callback ---------------------------


@hookspec
def register_transports(register: Callable[[type[Transport]], None]) -> None:
    """Register transport classes: call `register(cls)` for each.

    `cls` subclasses `enginehooks.transports.base.Transport` and sets a unique `name`;
    users then pick it with `WeightSync(transport=name)`. Two plugins registering the
    same name is an error naming both.
    """


@hookspec
def register_trainer_adapters(register: Callable[[type[TrainerAdapter]], None]) -> None:
    """Register trainer-side adapters: call `register(cls)` for each.

    `cls` subclasses `enginehooks.trainer_side.TrainerAdapter` (a `name`, a classmethod
    `accepts(model)`, `specs()` without gathering, the lazy `stream()` every trainer rank
    iterates, optional `cancel(reason)`), or `CheckpointAdapter` to stream a module in
    checkpoint format through transformers' own conversion. `WeightSync.push(model)`
    takes the first adapter, most recently registered first, that accepts the model.
    """


# -- data plane: built-ins delegate to the transport; a plugin may take a call over ----


@hookspec(firstresult=True)
def update_group(request: GroupUpdate) -> GroupResult | None:
    """Join or leave a transport group; return the opened or closed half.

    :param request: one typed request per mode (`enginehooks.transports.base`), each
        carrying only what its mode needs; `request.transport` names the transport and
        `request.action` / `request.side` the mode:

        - `JoinSender(transport, options)`: open the trainer's sender from `options`
          (keyword options for `Transport.sender`); return the `Sender`.
        - `JoinReceiver(transport, endpoint, rank, device)`: open a worker's receiver of
          the group at `endpoint` (the sender's, with `world_size`) as global `rank` on
          `device`, connected; return the `Receiver`.
        - `LeaveSender(transport, sender)`: close `sender`; return it.
        - `LeaveReceiver(transport, receiver)`: close `receiver`; return it.

    The group is rebuilt by leaving and joining again when replicas come or go. The
    first non-None result wins; the built-in implementation asks the registered
    transport. Callers ask through `request.ask(pm)`, which returns the mode's type and
    refuses any other answer with a `TransportError`.
    """


@hookspec(firstresult=True)
def send_weights(
    transport: str, sender: Sender, manifest: Manifest, stream: Stream, abort: Abort
) -> SendStats | None:
    """Trainer side: move every tensor of `stream`, as `manifest` plans, over `sender`.

    Runs on the sender rank while every engine worker is inside `receive_weights`.
    Must raise (never hang) when `abort` fires or a peer fails. First result wins.
    """


@hookspec(firstresult=True)
def receive_weights(
    transport: str, receiver: Receiver, manifest: Manifest, target: Target
) -> dict[str, Any] | None:
    """Engine side: take `manifest`'s update from `receiver` and apply it to `target`.

    Called inside every engine worker after the manifest was validated against the
    worker's model. Returns JSON-able stats. First result wins.
    """


# -- observability: wrapper=True implementations time or trace these -------------------


@hookspec(firstresult=True)
def run_phase(phase: str, report: PushReport, run: Callable[[], Any]) -> Any:
    """Run one phase of a push ("plan", "group", "check", "transfer", "finish"; with
    `wake_up=True` also "wake_weights" and "wake_kv_cache").

    The built-in implementation calls `run()`; wrappers (`@hookimpl(wrapper=True)`)
    around it time, log or profile the phase. The built-in timing wrapper writes
    `report.phases[phase]` in seconds.
    """


@hookspec
def push_finished(report: PushReport) -> None:
    """Called on the trainer side once per push, after success or failure, with the
    report (`report.error` is set on failure). For metrics exporters and loggers."""
