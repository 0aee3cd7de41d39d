"""`wire/schedule.py`'s needs (issue 40): what each engine worker's `info` reports of the
byte runs its loader reads, and every refusal the trainer makes before it schedules from
them (a refused report leaves the push on the broadcast path)."""

from __future__ import annotations

from typing import Any

import pytest

from enginehooks.core.manifest import TensorSpec
from enginehooks.core.schedule import Slice
from enginehooks.wire.schedule import MalformedNeeds, needs_from_wire, needs_to_wire

SPECS = [TensorSpec("a", "float32", (4, 4)), TensorSpec("b", "bfloat16", (8,))]
NEEDS = [Slice("a", 0, 16), Slice("a", 32, 48)]


def test_needs_round_trip_and_a_tensor_needed_by_nobody_has_no_runs() -> None:
    raw = needs_to_wire(NEEDS, SPECS)
    assert raw["b"] == {"dtype": "bfloat16", "runs": []}
    assert needs_from_wire(raw, SPECS, "w") == NEEDS


def _bad(mutate: Any) -> dict[str, Any]:
    raw = needs_to_wire(NEEDS, SPECS)
    mutate(raw)
    return raw


@pytest.mark.parametrize("raw, words", [
    (None, "no copy plan"),
    (_bad(lambda r: r.pop("b")), "says nothing about tensor 'b'"),
    (_bad(lambda r: r["a"].update(dtype="bfloat16")), "in 'bfloat16'"),
    (_bad(lambda r: r["a"]["runs"].append([60, 72])), "not a range"),
    (_bad(lambda r: r["a"]["runs"].append([8, 8])), "not a range"),
    (_bad(lambda r: r["a"]["runs"].append([-1, 8])), "not a range"),
    (_bad(lambda r: r["a"]["runs"].append([0, True])), "not a range"),
    (_bad(lambda r: r["a"]["runs"].append([0, 4, 8])), "not a range"),
])
def test_needs_the_trainer_cannot_schedule_from_are_refused(raw: Any, words: str) -> None:
    with pytest.raises(MalformedNeeds, match=words):
        needs_from_wire(raw, SPECS, "replica 'r' worker 0")


def test_evenly_spaced_runs_travel_as_one_item() -> None:
    # a row-parallel slice: 16 runs of 64 bytes, one per 128-byte row, then one more run
    spec = TensorSpec("o", "float32", (16, 32))
    rows = [Slice("o", 64 + 128 * i, 128 + 128 * i) for i in range(16)]
    needs = [Slice("o", 0, 8), *rows]
    raw = needs_to_wire(needs, [spec])
    assert raw["o"]["runs"] == [[0, 8], [64, 128, 128, 16]]
    assert needs_from_wire(raw, [spec], "w") == needs
    two = [Slice("o", 0, 8), Slice("o", 100, 108)]
    assert needs_from_wire(needs_to_wire(two, [spec]), [spec], "w") == two


@pytest.mark.parametrize("run", [
    [64, 128, 32, 4],      # a step shorter than a run: runs that overlap
    [64, 128, 128, 5],     # the last run ends past the tensor's 512 bytes
    [64, 128, 128, 0],     # no run
    [64, 128, 128],        # neither a run nor a spaced group
])
def test_spaced_runs_outside_the_tensor_or_overlapping_are_refused(run: list[int]) -> None:
    spec = TensorSpec("o", "float32", (8, 16))
    with pytest.raises(MalformedNeeds, match="not a range"):
        needs_from_wire({"o": {"dtype": "float32", "runs": [run]}}, [spec], "w")


def test_a_tensor_the_update_does_not_carry_is_ignored() -> None:
    raw = needs_to_wire(NEEDS, [*SPECS, TensorSpec("vision", "float32", (2,))])
    assert needs_from_wire(raw, SPECS, "w") == NEEDS
