"""`wire/schedule.py`'s instances (issue 40): the signed schedule binds each engine rank to
its worker's id, so a worker finds its rank in the text the trainer signed; a worker the
schedule does not name, and ids that cannot bind one worker per rank, are refused."""

from __future__ import annotations

from typing import Any

import pytest

from enginehooks.core.manifest import Manifest, TensorSpec, plan
from enginehooks.core.schedule import Transfer
from enginehooks.wire.schedule import MalformedSchedule, ShardSchedule

SPECS = [TensorSpec("a", "float32", (4, 4))]
TRANSFERS = (Transfer(0, 0, "a", 0, 32), Transfer(0, 1, "a", 32, 64))


def _of(meta: dict[str, Any]) -> ShardSchedule:
    m = plan(SPECS, weight_version=1, bucket_bytes=1024, meta={"schedule": meta})
    return ShardSchedule.of(Manifest.from_json(m.to_json()))


def test_each_worker_finds_its_rank_and_an_unnamed_worker_refuses() -> None:
    s = _of(ShardSchedule(1, 2, TRANSFERS, ("w-a", "w-b")).to_meta())
    assert (s.rank_of("w-a"), s.rank_of("w-b")) == (0, 1)
    with pytest.raises(MalformedSchedule, match="no engine rank for worker w-c"):
        s.rank_of("w-c")
    assert "instances" not in ShardSchedule(1, 2, TRANSFERS).to_meta()


@pytest.mark.parametrize("instances", [["w-a"], ["w-a", "w-a"], ["w-a", 3], "w-a"])
def test_ids_that_cannot_bind_one_worker_per_rank_are_refused(instances: Any) -> None:
    meta = {**ShardSchedule(1, 2, TRANSFERS).to_meta(), "instances": instances}
    with pytest.raises(MalformedSchedule, match="distinct worker ids"):
        _of(meta)
