"""Shard-direct along the static schedule (issue 40), process to process over gloo on
loopback: two FSDP2 trainer ranks (`fully_shard`, CPU) send only their own shards'
intersections with what each engine rank needs, straight to the two engine ranks of one
TP=2 module replica (`enginehooks_testkit/tp_module.py`), each a process of its own
(`shard_rank.py`). The engine ranks report their needs through `EngineSide.info`, rank 0
plans the schedule with `control/shard_schedule.ShardPlanner` and signs the manifest
with the `check` token, which each engine rank verifies
(tests/multihost/test_shard_direct_signed.py: a schedule changed after signing).

- Each engine rank equals, bit for bit, a fresh load of the trainer's weights; most bytes
  land straight in its parameters (the rows of q/k/v, gate/up, the embedding), the
  column slices are assembled and replayed, the tensor the loader computes with goes
  through the loader.
- The bytes sent are the model's bytes once within 2% (the replicated norms go to both
  engine ranks), each trainer rank sends its half, and no trainer rank runs a
  collective while sending (the counter sees the one a `full_tensor()` runs).
- The push runs with a shared secret: every range's digest is keyed (a changed byte is
  refused: tests/library/transports/test_shard_direct.py; `shard_rank.py`'s "corrupt"
  does it between processes, outside the test run, to keep the CI slot to one run).
"""

from __future__ import annotations

from typing import Any

from enginehooks_testkit import tp_module as tp
from tests.multihost.conftest import ROOT
from tests.support.ranks import free_port, run_modules

TIMEOUT_S = 60


def _run(**extra: Any) -> list[dict[str, Any]]:
    port = free_port()
    return run_modules("tests.multihost.shard_rank", [
        {"rank": rank, "trainers": 2, "engines": 2, "port": port, "seed": 5,
         "timeout_s": TIMEOUT_S, **extra} for rank in range(4)], ROOT, TIMEOUT_S * 4)


def _model_bytes() -> int:
    return sum(t.numel() * t.element_size() for t in tp.TinyFull().state_dict().values())


def test_two_fsdp2_ranks_feed_a_tp2_replica_each_byte_once_without_a_gather() -> None:
    t0, t1, e0, e1 = _run(secret="ab" * 16)
    for e in (e0, e1):
        assert "error" not in e, e
        assert e["equal"] is True
        assert e["how"]["layers.0.q_proj.weight"] == "direct"
        assert e["how"]["layers.0.o_proj.weight"] == "replayed"
        assert e["how"]["layers.0.scale"] == "loader"
        assert e["direct"] > e["received"] / 2
    for t in (t0, t1):
        assert "error" not in t, t
        assert t["collectives"] == 0
        assert t["verdicts"] == ["ok", "ok"]  # both engine ranks took the signed schedule
        assert t["control_collectives"] >= 1  # the counter sees a gather
    sent = t0["sent"] + t1["sent"]
    assert sent == e0["received"] + e1["received"]
    model = _model_bytes()
    assert model <= sent <= 1.02 * model, (sent, model)
    assert abs(t0["sent"] - t1["sent"]) <= 0.05 * sent

