"""`EngineSide.info`'s needs (issue 40): once a worker's copy plan is recorded, `info`
reports the byte runs of each checkpoint tensor its loader reads, as `needs_of` computes
them from that plan; before (or with the plan off) it reports none, so a trainer cannot
schedule shard-direct from a layout nobody learned."""

from __future__ import annotations

import pytest
import torch

from enginehooks.core.dtypes import dtype_name
from enginehooks.core.errors import ConfigError
from enginehooks.core.manifest import TensorSpec
from enginehooks.engine.copy_plan import PlanState, record_plan
from enginehooks.engine.local import LocalEngine
from enginehooks.engine.shard_direct import needs_of
from enginehooks.wire.schedule import NEEDS_KEY, needs_from_wire
from enginehooks_testkit import tp_module as tp


def _specs() -> list[TensorSpec]:
    return [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape))
            for n, t in tp.TinyFull().state_dict().items()]


def _engine(rank: int, plan_on: bool = True) -> LocalEngine:
    eng = LocalEngine(tp.TinyTP(rank, 2))
    with torch.device("meta"):
        skeleton = tp.TinyTP(rank, 2)
    state = PlanState("local")
    if plan_on:
        state.adopt(record_plan(skeleton, _specs(), tp.load_weights), None)
    eng.target.plan = state  # type: ignore[attr-defined]
    return eng


def test_info_reports_each_ranks_needs_from_its_recorded_plan() -> None:
    specs = _specs()
    q = next(s for s in specs if s.name == "layers.0.q_proj.weight")
    experts = []
    for rank in (0, 1):
        eng = _engine(rank)
        plan = eng.target.plan.plan  # type: ignore[attr-defined]
        got = needs_from_wire(eng.side.info(needs=True)[NEEDS_KEY], specs, f"rank {rank}")
        assert got == needs_of(plan, specs)
        # a tensor-parallel rank reads half of q_proj
        assert sum(s.stop - s.start for s in got if s.name == q.name) == q.nbytes // 2
        experts.append({s.name for s in got if ".experts." in s.name})
    # each rank its own experts, none of the other's
    assert experts[0] and experts[1] and not experts[0] & experts[1]


def test_needs_only_when_asked_and_through_the_wire_request() -> None:
    """Every full push asks `info`: the needs (large for a large model) come only to a
    trainer that asks for them, as the RPC carries the flag (text from the network)."""
    from enginehooks import wire
    from enginehooks.engine.contract import dispatch

    eng = _engine(0)
    assert NEEDS_KEY not in eng.side.info()
    assert NEEDS_KEY not in dispatch(eng.side, "info", wire.InfoRequest().args())
    assert NEEDS_KEY in dispatch(eng.side, "info", wire.InfoRequest(needs=True).args())
    assert NEEDS_KEY in dispatch(eng.side, "info", ["true"])
    assert NEEDS_KEY not in dispatch(eng.side, "info", ["false"])
    with pytest.raises(ConfigError, match="malformed argument"):
        dispatch(eng.side, "info", ["maybe"])


def test_no_needs_before_a_plan_is_recorded_or_with_it_off() -> None:
    assert NEEDS_KEY not in LocalEngine(tp.TinyTP(0, 2)).side.info(needs=True)
    eng = _engine(0, plan_on=False)
    eng.target.plan.disable("off for the test")  # type: ignore[attr-defined]
    assert NEEDS_KEY not in eng.side.info(needs=True)
