"""`Deadline`: one absolute deadline (monotonic clock) for everything one call waits on.

The one deadline of the package: a control call (`wire/` speaks of it:
each RPC and each phase of a push) and a whole transfer (the broadcast receivers bound
every bucket's wait by what is left of it, so a link that turns slow still ends the
update in time, instead of `timeout_s` after the last byte that trickled in) read the
same clock the same way. It lives in `core/` because both the control plane and the
transports use it, and neither may import the other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from enginehooks.core.errors import PushTimeout, TransferStalled, TransportError


@dataclass(frozen=True)
class Deadline:
    """`seconds` from when it was made, ending at `at` (`time.monotonic()`)."""

    at: float
    seconds: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + float(seconds), float(seconds))

    def left(self, floor: float = 0.0) -> float:
        """Seconds left (at least `floor`)."""
        return max(floor, self.at - time.monotonic())

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def check(self, what: str) -> None:
        """A control call: raise `PushTimeout` once the deadline passed."""
        if self.expired:
            raise PushTimeout(f"{what}: no answer within {self.seconds:g}s")

    def late(self, what: str) -> TransportError:
        """The error of a transfer that outlived the deadline."""
        return TransferStalled(f"{what}: the update did not arrive within "
                              f"{self.seconds:g}s (timeout_s bounds the whole "
                              f"transfer; raise it for slower links)")

    def within(self, what: str) -> float:
        """A transfer: seconds left for `what`; raises `late(what)` once none are."""
        seconds = self.at - time.monotonic()
        if seconds <= 0:
            raise self.late(what)
        return seconds
