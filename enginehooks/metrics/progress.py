"""`ProgressLine`: one status line for pushes that run long, from the `run_phase` and
`push_finished` hooks only.

A push shorter than `after_s` prints nothing. A longer one gets a line, rewritten in
place on a terminal (`\\r`) every `interval_s`, or printed anew at most every
`interval_s` elsewhere (logs), naming the phase running and its time so far, the
phases done and the planned payload; and a last line with the outcome. Transports
report no per-bucket progress through hooks, so the line says where the push is, not
how many bytes of the transfer have moved.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, TextIO

from enginehooks.markers import hookimpl

if TYPE_CHECKING:
    from enginehooks.core.report import PushReport


def size(n: int) -> str:
    """Bytes in the unit that reads best (decimal: kB, MB, GB)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


class _Push:
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.phase: str | None = None
        self.phase_t0 = self.t0
        self.stop = threading.Event()
        self.printed = False


class ProgressLine:
    """The plugin; `stream` defaults to stderr."""

    def __init__(self, stream: TextIO | None = None, after_s: float = 2.0,
                 interval_s: float = 1.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.after_s = after_s
        self.interval_s = interval_s
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._pushes: dict[int, _Push] = {}
        self._lock = threading.Lock()

    @hookimpl(wrapper=True)
    def run_phase(self, phase: str, report: PushReport, run: Callable[[], Any]) -> Generator:
        with self._lock:
            push = self._pushes.get(id(report))
            if push is None:
                push = self._pushes[id(report)] = _Push()
                threading.Thread(target=self._tick, args=(report, push), daemon=True,
                                 name="enginehooks-progress").start()
            push.phase, push.phase_t0 = phase, time.monotonic()
        try:
            return (yield)
        finally:
            push.phase = None

    @hookimpl
    def push_finished(self, report: PushReport) -> None:
        with self._lock:
            push = self._pushes.pop(id(report), None)
        if push is None:
            return
        push.stop.set()
        if not push.printed and time.monotonic() - push.t0 < self.after_s:
            return
        if report.ok:
            end = (f"done in {time.monotonic() - push.t0:.1f} s, {size(report.bytes)}, "
                   f"{report.gbps:.3f} GB/s in transfer")
        else:
            end = f"FAILED after {time.monotonic() - push.t0:.1f} s: {report.error}"
        self._write(f"push v{report.version} over {report.transport}: {end}", final=True)

    def line(self, report: PushReport, push: _Push) -> str:
        now = time.monotonic()
        done = ", ".join(f"{k} {v:.2f} s" for k, v in report.phases.items())
        phase = push.phase or "between phases"
        planned = f", {size(report.bytes)} planned" if report.bytes else ""
        return (f"push v{report.version} over {report.transport}: {phase} "
                f"{now - push.phase_t0:.1f} s (total {now - push.t0:.1f} s"
                + (f"; {done}" if done else "") + f"){planned}")

    def _tick(self, report: PushReport, push: _Push) -> None:
        if push.stop.wait(self.after_s):
            return
        while not push.stop.is_set():
            self._write(self.line(report, push))
            push.printed = True
            push.stop.wait(self.interval_s)

    def _write(self, text: str, final: bool = False) -> None:
        with self._lock:
            if self.tty:
                self.stream.write("\r\033[K" + text + ("\n" if final else ""))
            else:
                self.stream.write(text + "\n")
            self.stream.flush()
