"""`transports/shard_runs.Places` over plain (start, stop, bytes) segments per tensor, with
the per-range lookup the same bytes give (`at`: what a per-range `source`/`dest` answers),
for the shard-direct table tests on the host and on a GPU."""

from __future__ import annotations

import torch

from enginehooks.core.schedule import Transfer


class Segs:
    def __init__(self, segs: dict[str, list[tuple[int, int, torch.Tensor]]]) -> None:
        self.segs = segs

    def segments(self, name: str) -> list[tuple[int, int, torch.Tensor]]:
        return self.segs.get(name, [])

    def at(self, t: Transfer) -> torch.Tensor:
        for a, b, raw in self.segs[t.name]:
            if a <= t.start and t.stop <= b:
                return raw[t.start - a: t.stop - a]
        raise KeyError(t)
