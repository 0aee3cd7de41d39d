"""The static schedule moved into the package with the data path that uses it
(`enginehooks/core/schedule.py`, issue 40); this name is kept for the benchmarks and
the paper model that import it."""

from enginehooks.core.schedule import (
    ScheduleError,
    Slice,
    Transfer,
    dim0_shards,
    floor_seconds,
    link_bytes,
    schedule,
    view_slices,
)

__all__ = ["ScheduleError", "Slice", "Transfer", "dim0_shards", "floor_seconds", "link_bytes",
           "schedule", "view_slices"]
