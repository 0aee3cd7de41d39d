"""`MultiSenderSync`: deprecated name of `WeightSync(senders=ranks)`.

Several trainer ranks sending one update are `WeightSync` with a sender set: one push
routine for one sender and for several (`control/sync.py`, `control/senders.py`,
`docs/scale.md`). This name stays for code written against it.
"""

from __future__ import annotations

from typing import Any

from enginehooks.control.sync import WeightSync, require_several_senders
from enginehooks.trainer_side.channel import TrainerRanks


class MultiSenderSync(WeightSync):
    """Deprecated: `WeightSync(transport, senders=ranks, **kwargs)`."""

    def __init__(self, ranks: TrainerRanks | None, transport: str = "gloo",
                 **kwargs: Any) -> None:
        require_several_senders(transport)
        super().__init__(transport, senders=ranks, **kwargs)
