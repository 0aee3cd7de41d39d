"""Shard-direct's schedule is signed (issue 40), process to process on loopback
(`shard_rank.py`): rank 0 plans the schedule from the engine ranks' `info` needs
(`control/shard_schedule.ShardPlanner`) and signs the manifest with the `check` token;
a schedule changed after signing (another trainer rank for one range) is refused by
every engine rank's `EngineSide` verifier at check, and no byte moves."""

from __future__ import annotations

from tests.multihost.test_shard_direct import _run


def test_a_schedule_changed_after_signing_is_refused_and_nothing_is_sent() -> None:
    t0, t1, e0, e1 = _run(secret="ab" * 16, tamper=True)
    for e in (e0, e1):
        assert e.get("type") == "AuthError", e
        assert "received" not in e
    for t in (t0, t1):
        assert "error" not in t, t
        assert t["sent"] == 0
        assert all(v != "ok" for v in t["verdicts"])
