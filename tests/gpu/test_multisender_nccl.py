"""Several senders over NCCL (issue 23): 2 FSDP2 trainer ranks push into 2 module replicas.

Trainer ranks are processes on GPUs 0 and 1 (an NCCL world of 2, the model
`fully_shard`ed per layer); each replica is a process holding a zeroed module on GPU 2
or 3 behind a `LocalEngine`, so it receives through `EngineSide`, the nccl
`MultiReceiver` and `Receiver.deliver`, the code the engine plugins run
(`tests/gpu/multisender_procs.py`). Each push follows a perturbation of the trainer;
after each, both replicas must equal, tensor by tensor (sum64 of the bytes), the
trainer's full state dict.

The small-bucket case cuts the embedding (and the head) into many buckets: a rank that
sends it keeps the other rank's lockstep gathers waiting until its buckets drain. A
worker that receives the parts concurrently has part 1's first receive pending on its
GPU all that time, and the receives of part 0 behind it may not run: that hung on 4x
H200 (both the small buckets here and 256 MiB buckets of a 7B model). Workers now
receive every bucket in the send order the coordinator writes into the manifest
(`transports/multisender.py` has the cycle and the argument); each worker reports it.
Every wait is bounded (`Procs`: each answer has a deadline; the children are killed).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu.multisender_procs import Procs

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(420)]

TIMEOUT_S = 60.0
KiB, MiB = 1 << 10, 1 << 20


def four_gpus() -> pytest.MarkDecorator:
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(have < 4, reason=f"needs 4 CUDA GPUs (2 trainer ranks, 2 "
                                               f"replicas), found {have}")


def specs(h: int = 512, inter: int = 1376, vocab: int = 8192, layers: int = 3) -> list[list]:
    """Qwen2 names and layout (bf16: FSDP2 gathers one dtype per group); the embedding
    and the untied head are 8 MiB each."""
    kv = h // 4
    out: list[list] = [["model.embed_tokens.weight", "bfloat16", [vocab, h]]]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [[p + "input_layernorm.weight", "bfloat16", [h]],
                [p + "self_attn.q_proj.weight", "bfloat16", [h, h]],
                [p + "self_attn.q_proj.bias", "bfloat16", [h]],
                [p + "self_attn.k_proj.weight", "bfloat16", [kv, h]],
                [p + "self_attn.k_proj.bias", "bfloat16", [kv]],
                [p + "self_attn.v_proj.weight", "bfloat16", [kv, h]],
                [p + "self_attn.v_proj.bias", "bfloat16", [kv]],
                [p + "self_attn.o_proj.weight", "bfloat16", [h, h]],
                [p + "post_attention_layernorm.weight", "bfloat16", [h]],
                [p + "mlp.gate_proj.weight", "bfloat16", [inter, h]],
                [p + "mlp.up_proj.weight", "bfloat16", [inter, h]],
                [p + "mlp.down_proj.weight", "bfloat16", [h, inter]]]
    return [*out, ["model.norm.weight", "bfloat16", [h]],
            ["lm_head.weight", "bfloat16", [vocab, h]]]


def run(tmp: Path, mode: str, bucket: int, pushes: int = 3, single_device: str | None = None,
        backend: str = "nccl", devices: tuple[str, ...] = ("cuda:0", "cuda:1", "cuda:2", "cuda:3"),
        ) -> list[dict]:
    """`pushes` pushes (`mode` "multi" or "single"), each checked; `backend`/`devices`
    other than nccl on GPUs 0-3 only to try this file's logic on CPU (gloo)."""
    procs = Procs(specs(), backend=backend, trainer_devices=list(devices[:2]),
                  replica_devices=list(devices[2:]), timeout_s=TIMEOUT_S,
                  bucket_bytes=bucket, logdir=tmp, single_device=single_device)
    reports = []
    try:
        for v in range(pushes):
            procs.perturb(seed=v + 1)
            out = procs.push(mode, v)
            check = procs.check()
            assert check["bit_exact"], (f"push {v} ({mode}, bucket {bucket}): {check}; "
                                        f"logs in {tmp}")
            assert check["tensors"] == len(specs())
            reports.append(out)
        procs.call(procs.trainers, {"op": "close", "mode": mode})
    finally:
        procs.close()
    return reports


def senders_seen(report: dict) -> set:
    """How many senders each replica's worker received from (`MultiReceiver.deliver`)."""
    return {w.get("senders") for r in report.get("replica_stats") or []
            for w in (r or {}).get("workers") or []}


@four_gpus()
@pytest.mark.parametrize("bucket", [32 * MiB, 256 * KiB], ids=["one-bucket-each", "split-embedding"])
def test_two_fsdp2_ranks_send_their_parts_into_two_replicas_bit_exact(
        tmp_path: Path, bucket: int) -> None:
    reports = run(tmp_path, "multi", bucket)
    for r in reports:
        assert senders_seen(r) == {2}, r
        assert {w.get("in_order") for x in r.get("replica_stats") or []
                for w in (x or {}).get("workers") or []} == {True}, r
        assert r["bytes"] == sum(2 * torch.Size(s[2]).numel() for s in specs())
    if bucket < 8 * MiB:  # the embedding and the head each span several buckets
        assert reports[0]["buckets"] >= 2 * (8 * MiB // bucket)


@four_gpus()
def test_one_nccl_sender_without_a_device_uses_its_current_gpu(tmp_path: Path) -> None:
    """`WeightSync("nccl")` with no `device` (the docs' example) on an FSDP2 rank 0,
    rank 1 following: the sender takes the rank's current GPU (not an index-less
    "cuda", which `connect()` cannot set), and the replicas are bit-exact."""
    reports = run(tmp_path, "single", 1 * MiB, pushes=2, single_device=None)
    assert all(r["bytes"] for r in reports)
