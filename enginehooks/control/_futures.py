"""Futures on daemon threads.

Control-plane calls (engine RPCs, HTTP requests) block; the coordinator runs each on
its own thread and waits on the futures with a deadline. Daemon threads, unlike
`ThreadPoolExecutor`'s, are not joined at interpreter exit, so a call stuck in a dead
engine can never keep the trainer process from exiting.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


def spawn(fn: Callable[..., T], *args: Any, name: str = "enginehooks", **kwargs: Any) -> Future[T]:
    fut: Future[T] = Future()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:
            fut.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut
