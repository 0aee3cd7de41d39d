"""Plan once, push many on a real SGLang server (`core/layout.py`, issue 37 item 1).

The shared server of this suite: the first push of a `WeightSync` plans, asks, checks
and transfers; the next, with the same layout, is one call to the replica (`rpcs == 1`:
SGLang flushes its prefix cache inside that receive), and the server answers with the
new weights exactly as transformers does on them. A trainer in another dtype has another
layout: the full path again, still exact.
"""

from __future__ import annotations

from pathlib import Path

import torch

from enginehooks import WeightSync
from enginehooks.sglang_ext import SGLangServer
from enginehooks_testkit.tiny import load_tiny as load_hf
from enginehooks_testkit.tiny import perturb
from tests.sglang.helpers import SGLangServerProcess, hf_reference


def test_a_steady_push_to_sglang_is_one_call(sglang_server: SGLangServerProcess,
                                             model_dirs: dict[str, Path]) -> None:
    model = perturb(load_hf(model_dirs["llama"]), seed=81)
    sgl = SGLangServer(sglang_server.url, name="sglang")
    with WeightSync("gloo", bucket_bytes=32 << 10, timeout_s=90) as sync:
        sync.add_replica(sgl)
        first = sync.push(model, version=31)
        assert first.ok and first.layout == "planned" and first.rpcs >= 4
        report = sync.push(perturb(model, seed=82), version=32)
        assert report.ok and report.layout == "prepared"
        assert [r.rpcs for r in report.replicas] == [1]
        assert sglang_server.greedy() == (hf_reference(model), {"32"})
        # another dtype in the trainer: another layout, the full path
        double = load_hf(model_dirs["llama"]).to(torch.float64)
        double.load_state_dict(perturb(model, seed=83).state_dict())
        again = sync.push(double, version=33)
        assert again.ok and again.layout == "planned" and again.rpcs > 1
    assert sglang_server.greedy() == (hf_reference(model), {"33"})
