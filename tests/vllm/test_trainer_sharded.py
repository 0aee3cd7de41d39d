"""Sharded trainers pushing in lockstep: 2 trainer processes over gloo (CPU).

FSDP2 (`fully_shard`, real DTensors) pushes to the real vLLM server and greedy tokens
must equal HF transformers on the gathered weights; the go/no-go handshake releases
the follower when a replica refuses the manifest; a rank that stops iterating makes the
sender fail within the trainer group's timeout; the gather's peak memory is measured.
FSDP1 pushes into an in-process module replica and must arrive bit for bit. (Megatron:
tests/megatron, with real megatron-core ranks.)

Each scenario runs `python tests/test_trainer_sharded.py SCENARIO RANK WORLD PORT OUT`
in two processes under a timeout; each rank writes its findings to OUT/rankN.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import pytest

from enginehooks_testkit.engines import NEW_TOKENS, PROMPTS
from tests.support import ranks as support_ranks
from tests.support import requires_vllm

HERE = Path(__file__).resolve().parent
BUCKET = 32 << 10
PG_TIMEOUT_S = 4.0


# -- the launcher (pytest side) ------------------------------------------------------------
def run_ranks(scenario: str, out: Path, extra: dict[str, Any], timeout_s: float = 150.0,
              world: int = 2) -> list[dict[str, Any]]:
    """This file's ranks (`tests/support/ranks.py`)."""
    return support_ranks.run_ranks(__file__, scenario, out, extra, world, timeout_s)


# -- measurement helpers (trainer side) -----------------------------------------------------
class StreamMemory:
    """Bytes of the stream's tensors alive at once (weak references, so it sees exactly
    what the consumer still holds), and the largest single tensor."""

    def __init__(self) -> None:
        self.alive = self.peak = self.largest = self.count = 0

    def wrap(self, adapter: Any) -> None:
        inner = adapter._items

        def items() -> Any:
            for name, t in inner():
                if t is None:  # a tensor another rank sends: this one produced nothing
                    self.count += 1
                    yield name, t
                    continue
                n = t.numel() * t.element_size()
                self.alive += n
                self.peak = max(self.peak, self.alive)
                self.largest = max(self.largest, n)
                self.count += 1
                weakref.finalize(t, self._free, n)
                yield name, t
                del t

        adapter._items = items

    def _free(self, n: int) -> None:
        self.alive -= n


# -- the ranks ----------------------------------------------------------------------------
def _init(rank: int, world: int, port: int) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))


def _train_step(model: Any, seed: int) -> None:
    """One real FSDP step: forward, backward (reduce-scatter), SGD."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 200, (2, 12), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-0.5)
                p.grad = None


def scenario_fsdp2(rank: int, extra: dict[str, Any], out: Path) -> dict[str, Any]:
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from enginehooks import ManifestError, WeightSync
    from enginehooks.trainer_side import FSDP2Adapter, PushAborted, push
    from enginehooks_testkit.tiny import load_tiny as load_hf
    from enginehooks_testkit.tiny import perturb

    model = perturb(load_hf(Path(extra["model"])), seed=71)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    _train_step(model, 1)
    res: dict[str, Any] = {}
    sync = None
    if rank == 0:
        from enginehooks.vllm_ext import VLLMServer

        sync = WeightSync("gloo", bucket_bytes=BUCKET, timeout_s=60, pause=True)
        sync.add_replica(VLLMServer(extra["url"], name="server"))
    opts = dict(start_timeout_s=120.0)

    # 1. a normal push
    push(FSDP2Adapter(model, **opts), 1, sync=sync)

    # 2. the replica refuses the manifest (a tensor missing): the sender fails in `check`,
    #    the follower must be released with the sender's reason, not left in a gather.
    bad = FSDP2Adapter(model, include=lambda n: n != "model.norm.weight", **opts)
    t0 = time.monotonic()
    try:
        push(bad, 2, sync=sync)
        res["nogo"] = "pushed?!"
    except (ManifestError, PushAborted) as e:
        res["nogo"] = f"{type(e).__name__}: {e}"
    res["nogo_s"] = time.monotonic() - t0

    # 3. train on, push again (the trainer group is still healthy), measuring memory
    _train_step(model, 2)
    adapter = FSDP2Adapter(model, **opts)
    mem = StreamMemory()
    mem.wrap(adapter)
    report = push(adapter, 3, sync=sync)
    res.update(stream_peak=mem.peak, stream_largest=mem.largest, stream_count=mem.count)
    res["model_bytes"] = sum(s.nbytes for s in adapter.specs())
    res["largest_param"] = max(s.nbytes for s in adapter.specs())
    # test-only reference: the gathered new weights, saved by rank 0 for HF
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    if rank == 0:
        assert sync is not None and report is not None
        res["buckets"] = report.buckets
        res["version"] = sync.replicas[0].version()
        save_file({k: v.contiguous() for k, v in full.items()}, str(out / "weights.safetensors"))
        sync.close()
    return res


def scenario_stop(rank: int, extra: dict[str, Any], out: Path) -> dict[str, Any]:
    """Rank 1 stops iterating after 3 tensors and stays alive, silent."""
    from torch.distributed.fsdp import fully_shard

    from enginehooks import EngineHooksError, WeightSync
    from enginehooks.trainer_side import FSDP2Adapter, push
    from enginehooks_testkit.tiny import load_tiny as load_hf

    model = load_hf(Path(extra["model"]))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    adapter = FSDP2Adapter(model, start_timeout_s=120.0)
    if rank == 1:
        adapter.specs()
        it = adapter.stream()
        for _ in range(3):
            next(it)
        # a layer's gathers run together, when its first tensor is pulled: the first
        # tensor whose collective this rank never enters starts the next group
        sizes = [len(g.outputs) for g in adapter._layout.groups]
        missed = next(sum(sizes[:i + 1]) for i in range(len(sizes)) if sum(sizes[:i + 1]) >= 3)
        time.sleep(PG_TIMEOUT_S + 10)  # alive but no longer iterating
        return {"stopped_after": 3, "first_missed": missed}
    from enginehooks.vllm_ext import VLLMServer

    sync = WeightSync("gloo", bucket_bytes=BUCKET, timeout_s=60)
    sync.add_replica(VLLMServer(extra["url"], name="server"))
    t0 = time.monotonic()
    try:
        push(adapter, 30, sync=sync)
        err = "pushed?!"
    except EngineHooksError as e:
        err = f"{type(e).__name__}: {e}"
    elapsed = time.monotonic() - t0
    t1 = time.monotonic()
    sync.close()
    return {"error": err, "elapsed": elapsed, "close_s": time.monotonic() - t1}


def scenario_fsdp1(rank: int, extra: dict[str, Any], out: Path) -> dict[str, Any]:
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from enginehooks import WeightSync
    from enginehooks.engine.local import LocalEngine
    from enginehooks.trainer_side import FSDP1Adapter, push
    from enginehooks_testkit.tiny import load_tiny as load_hf
    from enginehooks_testkit.tiny import perturb

    res: dict[str, Any] = {}
    path = Path(extra["model"])

    def replica() -> tuple[Any, Any]:
        m = load_hf(path)
        with torch.no_grad():
            for p in m.parameters():
                p.zero_()
        return m, WeightSync("gloo", bucket_bytes=BUCKET, timeout_s=60)

    # FSDP1, one unit per decoder layer
    model = FSDP(perturb(load_hf(path), seed=81), device_id=torch.device("cpu"),
                 auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}))
    adapter = FSDP1Adapter(model, start_timeout_s=60.0)
    mem = StreamMemory()
    mem.wrap(adapter)
    sync = target = None
    if rank == 0:
        target, sync = replica()
        sync.add_replica(LocalEngine(target, name="fsdp1-replica"))
    push(adapter, 1, sync=sync)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        want = model.state_dict()  # test-only reference (the unbounded way)
    res["fsdp1_count"], res["fsdp1_stream_peak"] = mem.count, mem.peak
    res["fsdp1_largest_unit"] = max(
        u._handle.flat_param._unpadded_unsharded_size.numel() * 4
        for u in model.modules() if isinstance(u, FSDP) and u._handle is not None)
    if rank == 0:
        assert target is not None and sync is not None
        got = target.state_dict()
        res["fsdp1_names_equal"] = sorted(got) == sorted(want)
        res["fsdp1_bit_exact"] = all(torch.equal(got[k], want[k]) for k in want)
        sync.close()
    return res


def _main() -> None:
    scenario, rank, world, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        int(sys.argv[4]), Path(sys.argv[5])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(HERE))
    extra = json.loads((out / "extra.json").read_text())
    _init(rank, world, port)
    res = globals()[f"scenario_{scenario}"](rank, extra, out)
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown: a peer may be gone on purpose


if __name__ == "__main__":
    _main()


# -- the tests --------------------------------------------------------------------------------
@requires_vllm
@pytest.mark.vllm
@pytest.mark.slow
def test_fsdp2_two_ranks_push_to_vllm_matches_hf(vllm_server: Any, model_dirs: dict[str, Path],
                                                 tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from enginehooks_testkit.tiny import hf_greedy
    from enginehooks_testkit.tiny import load_tiny as load_hf

    r0, r1 = run_ranks("fsdp2", tmp_path, {"model": str(model_dirs["llama"]),
                                           "url": vllm_server.url})
    # go/no-go: the refused push failed on the sender, and the follower was told why
    assert r0["nogo"].startswith("ManifestError") and "refused the update" in r0["nogo"]
    assert r1["nogo"].startswith("PushAborted: trainer rank 1: the sender (rank 0) aborted the "
                                 "push: ManifestError: replica 'server' refused"), r1["nogo"]
    assert r1["nogo_s"] < 30
    assert r0["version"] == 3
    # the engine serves the trained weights: greedy tokens equal HF on them
    hf = load_hf(model_dirs["llama"])
    hf.load_state_dict(load_file(str(tmp_path / "weights.safetensors")))
    assert vllm_server.greedy() == hf_greedy(hf, PROMPTS, NEW_TOKENS)
    # memory: never the model; the largest parameter (+ the buckets on the sender)
    for r in (r0, r1):
        assert r["model_bytes"] >= 5 * r["largest_param"]
    assert r0["stream_largest"] == r0["largest_param"]
    assert r0["stream_peak"] <= r0["largest_param"], r0
    # the follower produces nothing (issue 37 item 5: it only contributes its shards to
    # the gathers to the sender), in step with the sender
    assert r1["stream_largest"] == r1["stream_peak"] == 0, r1
    assert r1["stream_count"] == r0["stream_count"]
    print(json.dumps({"sender": r0, "follower": r1}))


@requires_vllm
@pytest.mark.vllm
@pytest.mark.slow
def test_rank_that_stops_iterating_fails_push_within_timeout(
        vllm_server: Any, model_dirs: dict[str, Path], tmp_path: Path) -> None:
    r0, r1 = run_ranks("stop", tmp_path, {"model": str(model_dirs["llama"]),
                                          "url": vllm_server.url})
    assert r1["stopped_after"] == 3
    assert r0["error"].startswith("LockstepError"), r0["error"]
    # the error names the first tensor whose collective the stopped rank never entered
    assert f"tensor {r1['first_missed']} " in r0["error"] and "lockstep" in r0["error"]
    assert r0["elapsed"] < PG_TIMEOUT_S + 6, r0
    print(json.dumps(r0))


@pytest.mark.slow
def test_fsdp1_bit_exact(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    r0, r1 = run_ranks("fsdp1", tmp_path, {"model": str(model_dirs["llama"])})
    assert r0["fsdp1_names_equal"] and r0["fsdp1_bit_exact"]
    assert r0["fsdp1_count"] == r1["fsdp1_count"] > 0
    for r in (r0, r1):  # one parameter alive at a time, gathered one unit at a time
        assert r["fsdp1_stream_peak"] <= r["fsdp1_largest_unit"]
    print(json.dumps({"rank0": r0, "rank1": r1}))
