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


def test_a_tensor_the_update_does_not_carry_is_ignored() -> None:
    raw = needs_to_wire(NEEDS, [*SPECS, TensorSpec("vision", "float32", (2,))])
    assert needs_from_wire(raw, SPECS, "w") == NEEDS
