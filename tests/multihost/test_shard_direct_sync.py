"""Shard-direct as a path of the public API (issue 40): `WeightSync("shard",
senders=TrainerRanks(...))` on two FSDP2 trainer processes (`shard_sync_rank.py`), each
`push`ing its `fully_shard`ed model as a training loop would, into one TP=2 module
replica whose two workers are `EngineSide`s with the copy plan recorded from their
loader (hosted by rank 0).

- The coordinator asks the workers' needs once per layout (the first push only), plans
  the schedule into the signed manifest; each trainer rank sends only its own shards'
  intersections, point to point, with no collective inside its send; the workers go
  check -> receive -> apply -> current through their normal states and equal a fresh
  load of the pushed weights bit for bit, twice (the second push reuses the schedule).
  Bytes sent: the model's once, within 2%.
- A byte flipped after its range was digested ends the update `torn` on the worker that
  received it, and the push raises `ChecksumError` naming the tensor and the sender.
"""

from __future__ import annotations

from typing import Any

from enginehooks_testkit import tp_module as tp
from tests.multihost.conftest import ROOT
from tests.support.ranks import free_port, run_modules

TIMEOUT_S = 60
SECRET = "cd" * 16


def run(**extra: Any) -> list[dict[str, Any]]:
    """Both trainer ranks' answers (`shard_sync_rank.py`)."""
    master = f"127.0.0.1:{free_port()}"
    return run_modules("tests.multihost.shard_sync_rank", [
        {"rank": r, "world": 2, "master": master, "seed": 7, "timeout_s": TIMEOUT_S, **extra}
        for r in range(2)], ROOT, TIMEOUT_S * 4)


def test_two_fsdp2_ranks_push_shard_direct_through_weightsync_then_a_bad_byte_tears() -> None:
    """One pair of processes for both halves (the CI slot): two good pushes, then one
    whose range rank 1 changed after digesting it."""
    r0, r1 = run(pushes=["v1", "v2", "v3"], secret=SECRET, corrupt=1, corrupt_push=2)
    assert "error" not in r0 and "error" not in r1, (r0, r1)
    model = sum(t.numel() * t.element_size() for t in tp.TinyFull().state_dict().values())
    for i, version in enumerate(["v1", "v2"]):
        rep = r0["reports"][i]
        assert rep["ok"], rep
        assert r0["states"][i] == [["current", version], ["current", version]]
        assert r0["equal"][i] == [True, True]
        # each rank sent its own part of the schedule; together the model's bytes once
        parts = [r0["sent"][i], r1["sent"][i]]
        assert model <= sum(parts) <= 1.02 * model, (parts, model)
        assert abs(parts[0] - parts[1]) <= 0.05 * sum(parts)
        assert [s["bytes"] for s in rep["schedule"]] == parts
        received = [w["workers"][0]["schedule"]["received"] for w in rep["workers"]]
        assert sum(received) == sum(parts)
    assert r0["collectives"] == r1["collectives"] == [0, 0, 0]  # no gather while sending
    assert r0["needs_asked"] == 1  # once per layout: the later pushes held them
    # the third push: a byte changed after its range's digest
    rep = r0["reports"][2]
    assert rep["type"] == "ChecksumError", rep
    assert "from trainer rank 1" in rep["error"] and "keyed digest" in rep["error"]
    assert ["torn", None] in r0["states"][2]  # the worker that got the byte holds no version
    assert r1["reports"][2]["ok"] is False
