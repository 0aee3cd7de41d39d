"""`wire/schedule.py`: the static schedule in the signed manifest, read back and checked
by every engine rank before a byte moves (issue 40)."""

from __future__ import annotations

import random

import pytest

from enginehooks.core.manifest import Manifest, TensorSpec, plan
from enginehooks.core.schedule import Transfer
from enginehooks.wire import schedule as wire_schedule
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
    ({"senders": 2, "receivers": 2, "transfers": [[0, 0, "a", 0, 4], [True, 0, "a", 8, 12]]},
     "not a transfer"),
    ({"senders": 2, "receivers": 2, "transfers": [[0, 0, "a", 0, 4], [0, 0, 7, 8, 12]]},
     "not a transfer"),
    ({"senders": 2, "receivers": 2, "transfers": [[0, 0, "a", 0, 4], [0, 0, "a", 8, 1 << 70]]},
     "not a range"),
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


def _generated(seed: int, overlap: bool) -> tuple[dict[str, object], dict[str, int]]:
    """A schedule of a few thousand transfers (row-parallel-like runs, several tensors,
    senders and engine ranks), shuffled; with `overlap`, one run repeated to another
    sender (the same bytes to one engine rank twice)."""
    rng = random.Random(seed)
    sizes = {f"t{k}": 4096 * rng.randint(1, 8) for k in range(5)}
    items = []
    for name, n in sizes.items():
        for dst in range(3):
            for a in range(0, n, 64):
                items.append([rng.randint(0, 1), dst, name, a, a + rng.choice([16, 32, 64])])
    if overlap:
        src, dst, name, a, b = items[rng.randrange(len(items))]
        items.append([1 - src, dst, name, a, b])
    rng.shuffle(items)
    return {"senders": 2, "receivers": 3, "transfers": items}, sizes


@pytest.mark.parametrize("seed", range(4))
def test_column_checks_read_what_the_item_checks_read(seed: int) -> None:
    """The whole-column reading of a large schedule (`_columns`) gives exactly the item
    by item reading's transfers; the last schedule's transfers come back for the same
    items (the compiled peers find them by identity) and not for changed ones; a byte
    given twice is refused as item by item, naming the ranks."""
    raw, sizes = _generated(seed, overlap=False)
    got = ShardSchedule.from_meta(raw, sizes)
    want = wire_schedule._transfers_one_by_one(raw["transfers"], 2, 3, sizes)  # type: ignore[arg-type]
    assert got.transfers == want and len(want) > 1000
    again = ShardSchedule.from_meta({**raw, "transfers": [list(i) for i in raw["transfers"]]},
                                    sizes)
    assert again.transfers is got.transfers
    changed = [list(i) for i in raw["transfers"]]  # type: ignore[attr-defined]
    changed[0][4] = changed[0][3] + 8
    other = ShardSchedule.from_meta({**raw, "transfers": changed}, sizes)
    assert other.transfers is not got.transfers and other.transfers[0].stop == changed[0][4]
    bad, sizes = _generated(seed, overlap=True)
    with pytest.raises(MalformedSchedule, match=r"would receive bytes .* twice \(from trainer"):
        ShardSchedule.from_meta(bad, sizes)


def test_a_layout_reads_its_schedule_once_and_a_new_text_is_read_anew() -> None:
    """`SCHEDULE_MEMO`: the schedule read from a manifest is kept with it and carried to
    the same layout's next version (`with_version`: a prepared push reads nothing
    again); a manifest parsed from text is read (and checked) anew, and a malformed
    one is refused every time, never kept."""
    from enginehooks.core.layout import with_version

    m = _manifest(ShardSchedule(2, 2, GOOD).to_meta())
    first = ShardSchedule.of(m)
    assert ShardSchedule.of(m) is first
    assert ShardSchedule.of(with_version(m, 2)) is first
    again = ShardSchedule.of(Manifest.from_json(m.to_json()))
    assert again == first and again is not first
    bad = _manifest({"senders": 2, "receivers": 2, "transfers": [[2, 0, "a", 0, 4]]})
    for _ in range(2):
        with pytest.raises(MalformedSchedule, match="ranks outside"):
            ShardSchedule.of(bad)


def test_bytes_to_sums_each_tensors_ranges_per_engine_rank_once() -> None:
    s = ShardSchedule(2, 2, GOOD)
    assert s.bytes_to(0) == {"a": 64} and s.bytes_to(1) == {"b": 16}
    assert s.bytes_to(0) is s.bytes_to(0)  # kept with the schedule
    assert ShardSchedule(2, 2, GOOD) == s  # the memo is not part of the value
