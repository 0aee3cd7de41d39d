"""Several senders plan once and push many (issue 37 item 1, `control/senders.py`): two
trainer processes (`prepared_rank.py`) push through `WeightSync("gloo", senders=...)`
into two module replicas (hosted by rank 0), on loopback.

- FSDP2 ranks (`fully_shard`, gathered in lockstep): the first push plans in full; the
  second and third take the prepared layout (`report.layout == "prepared"`): two calls
  per replica (an `info`, which finds a restarted replica before anything streams, and
  the `receive` naming the layout), no plan, no check, every rank's part of the plan
  kept on that rank; the replicas equal the trainer's weights bit for bit after each.
- Each fallback plans in full within the push and lands exactly: rank 1's sender group
  broken (rank 1 says so when asked, and the group is formed anew); a replica restarted
  (its `info` names another instance); the prepared layout is taken again after each.
  A replica restarted with other shapes refuses the full path's manifest in its check,
  before any rank streams; the ranks are released (no lockstep flag left unread) and
  the next push lands.
- A byte flipped by rank 1 after sealing its bucket, on a prepared push, ends the update
  `torn` on the replicas with a `ChecksumError` (the receivers' digest check: without it
  the replicas would end `current` on wrong bytes); no rank is left in a lockstep
  collective, and the next push plans in full and lands.
- Ranks that each own their part (plain modules, rank 0 layer 0, rank 1 the rest): a
  change on rank 1 alone (its model in float64; a new tensor) is caught by rank 1's own
  check (`fallback: trainer rank 1: ...`), not by the coordinator's: the push plans in
  full (float64 lands exactly, in the replicas' float32; the new tensor is refused by
  the replicas' check before any byte moves, and they stay current).
- The same flipped byte on the owned ranks.
"""

from __future__ import annotations

from typing import Any

from tests.multihost.conftest import ROOT
from tests.support.ranks import free_port, run_modules

TIMEOUT_S = 8

STEPS: list[dict[str, Any]] = [
    {"version": "f1", "model": "fsdp2"},
    {"version": "f2", "model": "fsdp2"},
    {"version": "f3", "model": "fsdp2"},
    {"version": "f4", "model": "fsdp2", "do": "break"},
    {"version": "f5", "model": "fsdp2"},
    {"version": "f6", "model": "fsdp2", "do": "restart"},
    {"version": "f7", "model": "fsdp2"},
    {"version": "f8", "model": "fsdp2"},
    {"version": "f9", "model": "fsdp2", "do": "corrupt"},
    {"version": "f10", "model": "fsdp2"},
    {"version": "f11", "model": "fsdp2"},
    {"version": "f12", "model": "fsdp2", "do": "refuse"},
    {"version": "f13", "model": "fsdp2", "do": "restore"},
    {"version": "o1", "model": "owned"},
    {"version": "o2", "model": "owned"},
    {"version": "o3", "model": "owned", "do": "double"},
    {"version": "o4", "model": "owned"},
    {"version": "o5", "model": "owned", "do": "bonus"},
    {"version": "o6", "model": "owned", "do": "unbonus"},
    {"version": "o7", "model": "owned"},
    {"version": "o8", "model": "owned", "do": "corrupt"},
    {"version": "o9", "model": "owned"},
    {"version": "o10", "model": "owned"},
]


def test_several_senders_push_on_a_prepared_layout_and_fall_back_on_each_change() -> None:
    master = f"127.0.0.1:{free_port()}"
    r0, r1 = run_modules("tests.multihost.prepared_rank", [
        {"rank": r, "world": 2, "master": master, "timeout_s": TIMEOUT_S, "steps": STEPS}
        for r in range(2)], ROOT, 180)
    assert "error" not in r0 and "error" not in r1, (r0, r1)
    p = {s["version"]: (a, b) for s, a, b in zip(STEPS, r0["pushes"], r1["pushes"])}

    def landed(version: str) -> dict[str, Any]:
        rep, other = p[version]
        assert rep["ok"] and other["ok"], (version, rep, other)
        assert rep["states"] == [["current", version]] * 2, (version, rep)
        assert rep["equal"] == [True, True], (version, rep)
        return rep

    def torn(version: str) -> None:
        """A flipped byte on a prepared push: the replicas' digest check ends it torn."""
        rep, other = p[version]
        assert not rep["ok"] and rep["type"] == "ChecksumError", rep
        assert rep["layout"] == "prepared", rep
        assert not other["ok"] and "ChecksumError" in other["error"], other
        assert ["torn", None] in rep["states"], rep

    first = landed("f1")
    assert first["layout"] == "planned" and min(first["rpcs"]) >= 4  # info, join, check, receive
    for v in ("f2", "f3"):
        rep = landed(v)
        assert rep["layout"] == "prepared" and rep["rpcs"] == [2, 2], rep  # info, receive
        assert rep["bytes"] == first["bytes"]
    # rank 1's group broken: rank 1 says so; the group is formed anew and the push planned
    rep = landed("f4")
    assert rep["layout"].startswith("fallback: trainer rank 1: its sender's group"), rep
    assert min(rep["rpcs"]) >= 4, rep
    assert landed("f5")["layout"] == "prepared"
    # a replica restarted: its info names another instance; planned within the push
    rep = landed("f6")
    assert rep["layout"] == "fallback: replica 'r1' restarted or left the group", rep
    assert min(rep["rpcs"]) >= 4, rep
    assert landed("f7")["layout"] == "prepared"
    assert landed("f8")["layout"] == "prepared"
    torn("f9")
    assert landed("f10")["layout"] == "planned"
    assert landed("f11")["layout"] == "prepared"
    # a replica that refuses the manifest (restarted with other shapes): the full path's
    # check refuses it before any rank streams; no rank is left waiting for a flag
    rep, other = p["f12"]
    assert not rep["ok"] and rep["type"] == "ManifestError", rep
    assert rep["layout"] == "fallback: replica 'r1' restarted or left the group", rep
    assert not other["ok"] and rep["states"][0] == ["current", "f11"], (rep, other)
    assert landed("f13")["layout"] == "planned"  # restarted again with the right shapes
    # ranks that each own their part: another model, planned; then prepared
    assert landed("o1")["layout"] == "planned"
    assert landed("o2")["layout"] == "prepared"
    # rank 1's part changed dtype (rank 0's did not): rank 1's own check says so
    rep = landed("o3")
    assert rep["layout"].startswith("fallback: trainer rank 1: its model's layout changed"), rep
    assert landed("o4")["layout"] == "prepared"
    # rank 1's part gained a tensor: planned in full, refused by the replicas' check
    rep, _ = p["o5"]
    assert not rep["ok"] and rep["type"] == "ManifestError", rep
    assert rep["layout"].startswith("fallback: trainer rank 1: its model's layout changed"), rep
    assert rep["states"] == [["current", "o4"]] * 2, rep
    assert landed("o6")["layout"] == "planned"  # the failed push dropped the layout
    assert landed("o7")["layout"] == "prepared"
    torn("o8")
    assert landed("o9")["layout"] == "planned"
    assert landed("o10")["layout"] == "prepared"
