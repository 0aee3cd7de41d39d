"""`wire/schedule.py`: the static schedule in the signed manifest, read back and checked
by every engine rank before a byte moves (issue 40)."""

from __future__ import annotations

import pytest

from enginehooks.core.manifest import Manifest, TensorSpec, plan
from enginehooks.core.schedule import Transfer
from enginehooks.wire.schedule import MalformedSchedule, ShardSchedule

SPECS = [TensorSpec("a", "float32", (4, 4)), TensorSpec("b", "bfloat16", (8,))]
GOOD = (Transfer(0, 0, "a", 0, 32), Transfer(1, 0, "a", 32, 64), Transfer(1, 1, "b", 0, 16))


def _manifest(raw: object) -> Manifest:
    m = plan(SPECS, weight_version=1, bucket_bytes=1024, meta={"schedule": raw})
    return Manifest.from_json(m.to_json())  # as it crosses the network


def test_the_schedule_round_trips_through_the_manifest() -> None:
    s = ShardSchedule(2, 2, GOOD)
    m = plan(SPECS, weight_version=1, bucket_bytes=1024, meta=s.into({"x": 1}))
    back = ShardSchedule.of(Manifest.from_json(m.to_json()))
    assert back == s and m.meta["x"] == 1


@pytest.mark.parametrize(("raw", "match"), [
    (None, "carries no schedule"),
    ({"senders": 2, "receivers": 2}, "needs senders, receivers and transfers"),
    ({"senders": 0, "receivers": 2, "transfers": []}, "needs senders"),
    ({"senders": True, "receivers": 2, "transfers": []}, "needs senders"),
    ({"senders": 2, "receivers": 2, "transfers": [[0, 0, "a", 0]]}, "not a transfer"),
    ({"senders": 2, "receivers": 2, "transfers": [[0, -1, "a", 0, 4]]}, "not a transfer"),
    ({"senders": 2, "receivers": 2, "transfers": [[0, 0, "a", 0.5, 4]]}, "not a transfer"),
    ({"senders": 2, "receivers": 2, "transfers": [[2, 0, "a", 0, 4]]}, "ranks outside"),
    ({"senders": 2, "receivers": 2, "transfers": [[0, 2, "a", 0, 4]]}, "ranks outside"),
    ({"senders": 2, "receivers": 2, "transfers": [[0, 0, "c", 0, 4]]}, "no tensor 'c'"),
    ({"senders": 2, "receivers": 2, "transfers": [[0, 0, "b", 0, 17]]}, "not a range"),
    ({"senders": 2, "receivers": 2, "transfers": [[0, 0, "b", 4, 4]]}, "not a range"),
    ({"senders": 2, "receivers": 2, "transfers": [[0, 0, "a", 0, 40], [1, 0, "a", 32, 64]]},
     r"engine rank 0 would receive bytes \[32, 40\) of 'a' twice \(from trainer ranks 0 and 1\)"),
])
def test_a_schedule_an_engine_rank_cannot_trust_is_refused(raw: object, match: str) -> None:
    with pytest.raises(MalformedSchedule, match=match):
        ShardSchedule.of(_manifest(raw))


def test_the_same_bytes_to_two_engine_ranks_are_not_a_duplicate() -> None:
    raw = {"senders": 1, "receivers": 2, "transfers": [[0, 0, "b", 0, 16], [0, 1, "b", 0, 16]]}
    assert len(ShardSchedule.of(_manifest(raw)).transfers) == 2
