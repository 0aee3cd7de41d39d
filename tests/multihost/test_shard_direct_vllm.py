"""A real vLLM engine at tensor parallel 2 fed shard-direct by two trainer processes
(issue 40's oracle), outside CI (`ENGINEHOOKS_MULTIHOST_FULL=1`: two TP=2 vLLM servers
take minutes on the CI's two cores; the run's log is committed as
benchmarks/results/multihost/shard-direct-vllm-tp2.log).

Two FSDP2 trainer ranks (`multi_trainer.py`, mode "fsdp2", transport "shard": each
rank's model `fully_shard`ed over both, gloo, loopback) push with
`WeightSync("shard", senders=...)` into a vLLM server with `--tensor-parallel-size 2`:

- The first push is broadcast over the shard transport's groups (the workers have no
  copy plan yet, so they report no needs: `schedule` says why) and records each
  worker's copy plan.
- The second is shard-direct: the coordinator asks each worker's needs, the schedule
  travels in the signed manifest, each trainer rank sends only its own shards'
  intersections, with no collective inside its send; the bytes sent are the model's
  once within 2% (every byte once, the replicated norms once per worker), no waste, and
  both workers go check -> receive -> apply -> current.
- Each worker receives its replicated norms straight into its own tensors (`in_place`).
- The third push (the same sharded model, new values) takes the prepared layout.
- The exact oracle: greedy tokens and logprobs after the last push equal those of the
  same engine (TP=2) freshly loaded from `save_pretrained` of the pushed weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from enginehooks_testkit.tiny import load_tiny, make_tiny_model, perturb
from tests.multihost.test_multi_sender import FULL_ENV, Rank, _port, push


def norms_per_worker(model: Any) -> int:
    """The norm weights of `model` (each TP worker holds them whole)."""
    return sum(1 for n in model.state_dict() if "norm" in n)


@pytest.mark.skipif(not os.environ.get(FULL_ENV),
                    reason=f"outside CI (set {FULL_ENV}=1): two TP=2 vLLM servers take "
                           "minutes; the log is committed under benchmarks/results/")
def test_two_fsdp2_ranks_feed_a_tp2_vllm_shard_direct_and_it_equals_a_fresh_load(
        tmp_path: Path) -> None:
    from enginehooks.vllm_ext import VLLMServer
    from enginehooks_testkit.generation import first_difference
    from tests.vllm.conftest import VLLMServerProcess
    from tests.vllm.test_rl_flows_tp2 import TP, checkpoint, tp_env

    # the test Llama with two key/value heads: at TP=2 each worker holds one (with one,
    # vLLM replicates it: both workers need k_proj and v_proj whole, 8% more bytes here)
    like = make_tiny_model(tmp_path / "llama-kv2", arch="llama", kv_heads=2, seed=0)
    tp2 = ["--tensor-parallel-size", str(TP)]
    server = VLLMServerProcess(like, tmp_path / "vllm.log", env=tp_env(), extra_args=tp2)
    ranks: list[Rank] = []
    try:
        server.wait_ready(timeout_s=600.0)
        before = server.generations()
        _port[0] += 7
        for r in range(2):
            spec = {"model_dir": str(like), "host": "127.0.0.1", "rank": r, "world": 2,
                    "master": f"127.0.0.1:{_port[0]}", "timeout_s": 120.0,
                    "bucket_bytes": 64 << 10, "mode": "fsdp2", "transport": "shard",
                    "keep_model": True,
                    "replicas": ([{"kind": "vllm", "url": server.url, "name": "vllm"}]
                                 if r == 0 else [])}
            ranks.append(Rank(None, spec, tmp_path / f"rank{r}.log"))
        for r in ranks:
            r.lines.json(120.0)
        first = push(ranks, 77, "shard-1")
        assert all(o["ok"] for o in first), first
        assert str(first[0]["schedule"]).startswith("off: MalformedNeeds"), first[0]
        out = push(ranks, 78, "shard-2")
        assert all(o["ok"] for o in out), out
        model = out[0]["bytes"]  # the manifest's: the model's bytes once
        parts = [o["sends"]["sent"][-1] for o in out]
        sched = out[0]["schedule"]
        assert [s["bytes"] for s in sched] == parts, sched
        assert model <= sum(parts) <= 1.02 * model, (parts, model)
        # exactly: every byte once, the replicated norms once per worker
        pushed = perturb(load_tiny(like), seed=78)
        norms = sum(t.numel() * t.element_size() for n, t in pushed.state_dict().items()
                    if "norm" in n)
        assert sum(parts) == model + norms, (parts, model, norms)
        assert all(o["sends"]["collectives"][-1] == 0 for o in out), out
        workers = out[0]["workers"][0]["workers"]
        assert len(workers) == TP
        assert sum(w["schedule"]["received"] for w in workers) == sum(parts), workers
        # each worker is sent its replicated norms whole: received in its own tensors
        assert [w["schedule"]["in_place"] for w in workers] == [norms_per_worker(pushed)] * TP
        # the third push: the prepared layout (no plan, no check, the references only)
        third = push(ranks, 79, "shard-3")
        assert all(o["ok"] for o in third), third
        assert third[0]["layout"] == "prepared", third[0]
        assert [s["bytes"] for s in third[0]["schedule"]] == parts
        pushed = perturb(load_tiny(like), seed=79)
        infos = VLLMServer(server.url).info(60)
        assert [(i["version"], i["state"]) for i in infos] == [("shard-3", "current")] * TP
        got = server.generations()
        assert first_difference(got, before) is not None, "the pushes changed nothing"
        assert {g.version for g in got} == {"shard-3"}
        folder = checkpoint(pushed, like, tmp_path / "fresh")
        server.stop()
        fresh = VLLMServerProcess(folder, tmp_path / "fresh.log", env=tp_env(), extra_args=tp2)
        try:
            fresh.wait_ready(timeout_s=600.0)
            want = fresh.generations()
        finally:
            fresh.stop()
        diff = first_difference(got, want)
        print(f"shard-direct 2 FSDP2 ranks -> vLLM TP=2: sent {parts} of {model} model bytes "
              f"({sum(parts) / model:.4f}x), push {out[0]['seconds']:.2f} s, then prepared "
              f"{third[0]['seconds']:.2f} s (calls {third[0]['rpcs']}), schedule {sched}, "
              f"workers {[w['schedule'] for w in workers]}, "
              f"verification {[i.get('verification', {}).get('last') for i in infos]}; "
              f"equal to a fresh TP=2 load: {diff is None}")
        assert diff is None, f"vLLM TP=2 after a shard-direct push != freshly loaded: {diff}"
    finally:
        for r in ranks:
            r.close()
        server.stop()
