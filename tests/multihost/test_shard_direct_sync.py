"""Shard-direct as a path of the public API (issue 40): `WeightSync("shard",
senders=TrainerRanks(...))` on two FSDP2 trainer processes (`shard_sync_rank.py`), each
`push`ing its `fully_shard`ed model as a training loop would, into one TP=2 module
replica whose two workers are `EngineSide`s with the copy plan recorded from their
loader (hosted by rank 0).

- The coordinator asks the workers' needs once per layout (the first push only), plans
  the schedule into the signed manifest; each trainer rank sends only its own shards'
  intersections, point to point, with no collective inside its send; the workers go
  check -> receive -> apply -> current through their normal states and equal a fresh
  load of the pushed weights bit for bit, twice. Bytes sent: the model's once, within 2%.
- Plan once, push many (issue 37 item 1): the second push of the same model takes the
  prepared layout, one `info` and one signed `receive` per worker (the `info` finds a
  restarted worker or a copy plan recorded anew before any rank streams), and every
  rank rebuilds the schedule from the manifest it kept.
- A byte flipped after its range was digested ends the update `torn` on the worker that
  received it, and the push raises `ChecksumError` naming the tensor and the sender;
  the next push plans in full again and lands.
- A worker whose copy plan was recorded anew (another plan object) is found by its
  needs digest: that push plans the schedule in full (`fallback: ...`) and lands. With
  one sender (no `info` on a prepared push) the worker itself refuses the layout
  (`LayoutUnknown`, before anything changes) and the push falls back the same way.
"""

from __future__ import annotations

from typing import Any

from enginehooks_testkit import tp_module as tp
from tests.multihost.conftest import ROOT
from tests.support.ranks import free_port, run_modules

TIMEOUT_S = 60
SECRET = "cd" * 16


def run(world: int = 2, **extra: Any) -> list[dict[str, Any]]:
    """Every trainer rank's answers (`shard_sync_rank.py`)."""
    master = f"127.0.0.1:{free_port()}"
    return run_modules("tests.multihost.shard_sync_rank", [
        {"rank": r, "world": world, "master": master, "seed": 7, "timeout_s": TIMEOUT_S,
         **extra} for r in range(world)], ROOT, TIMEOUT_S * 4)


def test_two_fsdp2_ranks_push_shard_direct_through_weightsync_then_a_bad_byte_tears() -> None:
    """One pair of processes for both halves (the CI slot): a planned push, a prepared
    one, one whose range rank 1 changed after digesting it (on the prepared layout),
    then a planned one that lands again."""
    r0, r1 = run(pushes=["v1", "v2", "v3", "v4"], secret=SECRET, corrupt=1, corrupt_push=2)
    assert "error" not in r0 and "error" not in r1, (r0, r1)
    model = sum(t.numel() * t.element_size() for t in tp.TinyFull().state_dict().values())
    for i, version in [(0, "v1"), (1, "v2"), (3, "v4")]:
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
    layouts = [rep.get("layout") for rep in r0["reports"]]
    assert layouts[0] == "planned" and layouts[1] == "prepared", layouts
    assert layouts[2] == "prepared" and layouts[3] == "planned", layouts
    # a prepared push: one `info` (restarts, copy plans) and one `receive` per worker
    assert r0["reports"][1]["rpcs"] == [2, 2], r0["reports"][1]
    assert r0["reports"][0]["rpcs"][0] > 2
    assert r0["collectives"] == r1["collectives"] == [0, 0, 0, 0]  # no gather in a send
    assert r0["needs_asked"] == 1  # once per layout: the later pushes held them
    # the third push: a byte changed after its range's digest
    rep = r0["reports"][2]
    assert rep["type"] == "ChecksumError", rep
    assert "from trainer rank 1" in rep["error"] and "keyed digest" in rep["error"]
    assert ["torn", None] in r0["states"][2]  # the worker that got the byte holds no version
    assert r1["reports"][2]["ok"] is False


def test_a_copy_plan_recorded_anew_keeps_the_layout_and_one_turned_off_falls_back() -> None:
    """Worker 1 records its copy plan again before the third push (the same bytes read:
    the same needs digest, the layout holds) and turns it off before the fourth (as
    verification turns off a plan it finds wrong): the prepared layout's `info` finds
    no needs digest and the push plans in full, which broadcasts (no schedule without
    every worker's plan) and lands."""
    r0, r1 = run(pushes=["v1", "v2", "v3", "v4"], replan_at=2, off_at=3)
    assert "error" not in r0 and "error" not in r1, (r0, r1)
    assert all(rep["ok"] for rep in r0["reports"]), r0["reports"]
    layouts = [rep.get("layout") for rep in r0["reports"]]
    assert layouts[:3] == ["planned", "prepared", "prepared"], layouts
    assert layouts[3].startswith("fallback: replica 'tp1'") and "copy plan" in layouts[3]
    assert str(r0["reports"][3]["schedule"]).startswith("off:"), r0["reports"][3]
    assert r0["needs_asked"] == 2  # not for the plan recorded anew; for the one off
    assert all(s == [["current", v]] * 2 for s, v in zip(r0["states"], ["v1", "v2", "v3", "v4"]))
    assert all(e == [True, True] for e in r0["equal"])


def test_one_sender_checks_its_schedule_before_streaming_and_a_worker_refuses_a_stale_one(
        ) -> None:
    """One trainer rank (`WeightSync("shard")`, no `senders`): a prepared push is one
    `info` (the check above, before anything streams) and one signed `receive` per
    worker. A worker whose plan was turned off and is sent the prepared layout's
    reference all the same (by a trainer that did not ask) refuses it with
    `LayoutUnknown` and changes nothing."""
    (r0,) = run(world=1, pushes=["v1", "v2", "v3"], secret=SECRET, probe=True)
    assert "error" not in r0, r0
    assert all(rep["ok"] for rep in r0["reports"]), r0["reports"]
    layouts = [rep.get("layout") for rep in r0["reports"]]
    assert layouts == ["planned", "prepared", "prepared"], layouts
    assert r0["reports"][1]["rpcs"] == [2, 2]
    assert all(s == [["current", v]] * 2 for s, v in zip(r0["states"], ["v1", "v2", "v3"]))
    assert all(e == [True, True] for e in r0["equal"])
    probe = r0["probe"]
    assert probe["answer"].startswith("LayoutUnknown") and "copy plan" in probe["answer"]
    assert probe["before"] == probe["after"] == ["current", "v3"], probe
