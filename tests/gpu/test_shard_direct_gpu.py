"""Shard-direct over NCCL on 4 GPUs (issue 40, part 3's device run): 2 FSDP2 trainer
ranks (GPUs 0 and 1) send only their shards' intersections with what each engine rank
needs, point to point, into the 2 engine ranks of one TP=2 module replica (GPUs 2 and
3), each a process of its own (`tests/gpu/shard_gpu_rank.py`; the replica is
`enginehooks_testkit/tp_module.py`, as in tests/multihost/test_shard_direct.py).

One run of the four processes, three pushes:
- packed below the default `PACK_BELOW` (the row-parallel runs) and alone above it,
  `sum64` digests on the device: each engine rank's parameters equal, bit for bit, a
  fresh load of the trainer's weights; most bytes landed straight in its parameters;
  the bytes sent are the bytes received and the model's bytes once (within 2%: the
  replicated norms go to both engine ranks), each trainer rank sending its half;
- keyed (a shared secret: each range's MAC) with more ranges alone (`pack_below`
  4 KiB): bit-exact again;
- each side finding its ranges as tables (`transports/shard_runs.py`: one launch per
  peer packs, unpacks and digests) on the first two pushes, then the sender alone, the
  receiver alone (keyed) and neither (no checksum): the two paths put the same bytes
  and seals on the wire, so every mix is bit-exact;
- trainer rank 1 flips a byte of its first message to each engine rank after sealing it:
  both engine ranks end with `ChecksumError` naming that tensor and the sender (this
  fails if the receiver's digest compare is removed: the bytes would land silently).

And the public API (`tests/gpu/shard_sync_gpu_rank.py`): `WeightSync("shard_nccl",
senders=TrainerRanks(...))` on both trainer processes, each `push`ing its `fully_shard`ed
model, into the two workers of the TP=2 replica, each a process with an `EngineSide`
behind HTTP: two keyed pushes planned and sent along the schedule over the transport's
NCCL groups, then one whose range trainer rank 1 flipped after sealing, refused with
`ChecksumError` naming the tensor and the sender, nothing applied (each worker still
equals the last good push bit for bit).

On one GPU: the device seals (`_seal_all`: `sum64` per range on the GPU) equal the host's.

Every wait is bounded (`run_modules` kills the ranks past its timeout; each rank's NCCL
waits are polled CUDA events against `TIMEOUT_S`). A stuck rank prints every thread's
stack to stderr before it is killed (`faulthandler`, `spec_main`), each rank writes
timestamped progress lines there, and a failure shows the tail of every rank's stderr;
the files stay under $ENGINEHOOKS_GPU_LOGDIR when it is set.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import enginehooks.transports.shard_direct as sd
from tests.multihost.conftest import ROOT
from tests.support.ranks import free_port, run_modules

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

TIMEOUT_S = 45
#: the four processes' wall time (start, CUDA and NCCL init, three pushes of a small model)
RUN_S = 130
DIMS = {"vocab": 2048, "hidden": 256, "inter": 768, "layers": 2, "experts": 4}
SECRET = "ab" * 16


def four_gpus() -> pytest.MarkDecorator:
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(have < 4, reason=f"needs 4 CUDA GPUs (2 trainer ranks, 2 "
                                               f"engine ranks), found {have}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("secret", [None, b"k" * 32], ids=["digest", "keyed"])
def test_device_seals_are_the_host_seals(secret: bytes | None) -> None:
    """`_seal_all` on a GPU (`sum64` per range on the device, the length term added
    there, read once) gives the words `_seal` gives per range on the host: ranges at odd
    offsets, with tails, and past 8 MiB (where `n << 40` wraps modulo 2**64)."""
    g = torch.Generator().manual_seed(0)
    host = torch.randint(0, 256, (20_000_003,), dtype=torch.uint8, generator=g)
    cuts = [(3, 1, 8), (5, 2, 9_000_003), (9, 0, 16_777_217), (11, 5, 1005)]
    dev = host.to("cuda")
    got = sd._seal_all(secret, 7, [(i, dev[a:b]) for i, a, b in cuts], "sum64")
    assert got.device.type == "cuda"
    want = [w for i, a, b in cuts for w in sd._seal(secret, 7, i, host[a:b], "sum64")]
    assert got.tolist() == want


@four_gpus()
def test_two_fsdp2_ranks_feed_a_tp2_replica_over_nccl_bit_exact_then_a_bad_byte_is_refused(
        ) -> None:
    port = free_port()
    pushes = [{"mode": "shard", "checksum": "sum64"},
              {"mode": "shard", "checksum": "sum64", "secret": SECRET, "pack_below": 4096},
              {"mode": "shard", "checksum": "sum64", "tables": "send"},
              {"mode": "shard", "checksum": "sum64", "tables": "receive", "secret": SECRET},
              {"mode": "shard", "checksum": None, "tables": "none"},
              {"mode": "shard", "checksum": "sum64", "corrupt": 1}]
    t0, t1, e0, e1 = run_modules("tests.gpu.shard_gpu_rank", [
        {"rank": r, "port": port, "seed": 5, "dims": DIMS, "timeout_s": TIMEOUT_S,
         "pushes": pushes, "how": True, "deadline_s": RUN_S - 10} for r in range(4)],
        ROOT, RUN_S, label="shard_gpu")
    for r in (t0, t1, e0, e1):
        assert "error" not in r, r
        assert len(r["pushes"]) == 6, r
    model = t0["model_bytes"]
    for i in range(5):
        sent = [t["pushes"][i]["sent"] for t in (t0, t1)]
        received = [e["pushes"][i]["received"] for e in (e0, e1)]
        for e in (e0, e1):
            p = e["pushes"][i]
            assert "error" not in p, p
            assert p["equal"] is True, p
            assert p["how"]["layers.0.q_proj.weight"] == "direct"
            assert p["how"]["layers.0.o_proj.weight"] == "replayed"
            assert p["how"]["layers.0.scale"] == "loader"
            assert p["direct"] > p["received"] / 2, p
        assert all("error" not in t["pushes"][i] for t in (t0, t1))
        # each byte once: what was sent arrived, the model's bytes within 2%
        assert sum(sent) == sum(received) == t0["schedule_bytes"], (sent, received)
        assert model <= sum(sent) <= 1.02 * model, (sent, model)
        assert abs(sent[0] - sent[1]) <= 0.05 * sum(sent), sent
    flipped = t1["pushes"][5]["corrupted"]
    assert len(flipped) == 2, t1["pushes"][5]  # its first message to each engine rank
    for e, name in zip((e0, e1), flipped):
        p = e["pushes"][5]
        assert p.get("type") == "ChecksumError", p
        assert f"of {name!r} from trainer rank 1" in p["error"], p


@four_gpus()
def test_weightsync_shard_nccl_pushes_along_the_schedule_and_refuses_a_bad_byte(
        tmp_path: Path) -> None:
    base = {"dir": str(tmp_path), "master": f"127.0.0.1:{free_port()}", "seeds": [3, 4, 5],
            "timeout_s": TIMEOUT_S, "secret": SECRET, "corrupt": [1, 2],
            "deadline_s": 2 * RUN_S - 10}
    r0, r1, w0, w1 = run_modules("tests.gpu.shard_sync_gpu_rank",
                                 [{**base, "role": "trainer", "rank": r} for r in range(2)]
                                 + [{**base, "role": "engine", "rank": e} for e in range(2)],
                                 ROOT, 2 * RUN_S, label="shard_sync_gpu")
    for r in (r0, r1, w0, w1):
        assert "error" not in r, r
    for i in (0, 1):
        rep = r0["reports"][i]
        assert rep["ok"], rep
        sched = rep["schedule"]  # scheduled, not broadcast: each rank sent its own part
        assert [s["rank"] for s in sched] == [0, 1], rep
        parts = [s["bytes"] for s in sched]
        # the report's bytes are the model's once; the replicated norms go to both workers
        assert rep["bytes"] <= sum(parts) <= 1.02 * rep["bytes"], rep
        assert abs(parts[0] - parts[1]) <= 0.05 * sum(parts), parts
    bad = r0["reports"][2]
    assert bad["type"] == "ChecksumError", bad
    assert "from trainer rank 1" in bad["error"] and "keyed digest" in bad["error"], bad
    assert r1["reports"][2]["ok"] is False
    for w in (w0, w1):
        assert w["equal"] is True, w  # the last good push, bit for bit: nothing applied


@pytest.mark.skipif((torch.cuda.device_count() if torch.cuda.is_available() else 0) < 2,
                    reason="needs 2 CUDA GPUs (1 trainer rank, 1 engine rank)")
def test_one_fsdp2_rank_feeds_one_engine_rank_over_nccl_then_a_bad_byte_is_refused() -> None:
    """The same path on a 2-GPU host: one FSDP2 rank (GPU 0) sends along the schedule to
    the one rank of a TP=1 replica (GPU 1) over NCCL: batched point to point, device
    seals, landing in the engine's GPU parameters; bit-exact, each byte once, and a byte
    flipped after sealing is a `ChecksumError` naming its tensor (the protective line:
    the receiver's digest compare)."""
    port = free_port()
    pushes = [{"mode": "shard", "checksum": "sum64"},
              {"mode": "shard", "checksum": "sum64", "secret": SECRET, "pack_below": 4096},
              {"mode": "shard", "checksum": "sum64", "tables": "send"},
              {"mode": "shard", "checksum": "sum64", "tables": "receive", "secret": SECRET},
              {"mode": "shard", "checksum": "sum64", "corrupt": 0},
              {"mode": "shard", "checksum": "sum64", "corrupt": 0, "tables": "none"}]
    t0, e0 = run_modules("tests.gpu.shard_gpu_rank", [
        {"rank": r, "port": port, "seed": 5, "dims": DIMS, "timeout_s": TIMEOUT_S,
         "pushes": pushes, "how": True, "deadline_s": RUN_S - 10, "trainers": 1,
         "engines": 1} for r in range(2)], ROOT, RUN_S, label="shard_gpu_2")
    for r in (t0, e0):
        assert "error" not in r, r
        assert len(r["pushes"]) == 6, r
    for i in range(4):
        p = e0["pushes"][i]
        assert "error" not in p and p["equal"] is True, p
        assert p["direct"] > p["received"] / 2, p
        assert t0["pushes"][i]["sent"] == p["received"] == t0["schedule_bytes"], (t0, p)
        assert t0["model_bytes"] <= p["received"] <= 1.02 * t0["model_bytes"], p
    for i in (4, 5):  # a flipped byte refused on the table path and on the per-range one
        flipped = t0["pushes"][i]["corrupted"]
        p = e0["pushes"][i]
        assert len(flipped) == 1 and p.get("type") == "ChecksumError", p
        assert f"of {flipped[0]!r} from trainer rank 0" in p["error"], p
