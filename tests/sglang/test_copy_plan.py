"""The copy plan in a real SGLang server (the session's shared one).

The first push through SGLang's `load_weights` records the plan from SGLang's own loader
(the meta skeleton under the tracer) and checks it on the fresh-load shadow; the next
push writes planned tensors straight into the parameters inside SGLang's weight-update
session and is verified against a fresh load bit for bit, which turns the plan on.
Generation then equals the HF reference of the pushed weights, and `info` reports what
went through the plan. (Other tests of the session may have pushed first: the plan is
per process, so the assertions hold whichever push recorded it.)
"""

from __future__ import annotations

from pathlib import Path

from enginehooks import WeightSync
from enginehooks.sglang_ext import SGLangServer
from enginehooks_testkit.tiny import load_tiny, perturb
from tests.sglang.helpers import SGLangServerProcess, hf_reference


def test_planned_push_is_verified_and_matches_hf(sglang_server: SGLangServerProcess,
                                                 model_dirs: dict[str, Path]) -> None:
    handle = SGLangServer(sglang_server.url, name="sglang-plan")
    with WeightSync("gloo", bucket_bytes=32 << 10, timeout_s=60, pause=True) as sync:
        sync.add_replica(handle)
        sync.push(perturb(load_tiny(model_dirs["llama"]), seed=71), version="plan-record")
        plan = handle.info(30)[0]["copy_plan"]
        assert plan["state"] in ("verifying", "on"), plan
        assert plan["planned"] > 0, plan
        applied = plan["applied"]
        model = perturb(load_tiny(model_dirs["llama"]), seed=72)
        sync.push(model, version="plan-apply")
    info = handle.info(30)[0]
    plan = info["copy_plan"]
    assert plan["state"] == "on", plan
    assert plan["applied"] == applied + 1 and plan["planned_last"] > 0, plan
    if applied == 0:  # this push was the first through the plan: verified bit for bit
        assert info["verification"]["last"]["ok"] is True
        assert info["verification"]["last"]["mismatched"] == []
    tokens, versions = sglang_server.greedy()
    assert tokens == hf_reference(model)
    assert versions == {"plan-apply"}
