"""GPU transports with torch alone (the engines cannot run on the GPU machines).

The sender runs in the test process on cuda:0; each receiver is a separate Python
process that loads every push into a torch module through `ModuleTarget`, i.e. through
the same `Receiver.deliver` the engine plugins call, and prints the crc32 of every
received tensor. Bit-exact means equal crc32 of the raw bytes, per tensor, per push.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from enginehooks.core.manifest import TensorSpec, plan
from enginehooks.plugins import get_transport
from enginehooks.transports.base import Abort
from enginehooks.transports.cuda_ipc import _layout

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.gpu


def gpus(n: int) -> pytest.MarkDecorator:
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(have < n, reason=f"needs {n} CUDA GPUs, found {have}")


BUCKET = 1 << 20  # 1 MiB: the 2-4 MiB tensors below are split across buckets

SPECS = [
    TensorSpec("embed.weight", "bfloat16", (1024, 1000)),  # 2 MB: three buckets
    TensorSpec("layers.0.attn.qkv.weight", "bfloat16", (384, 128)),
    TensorSpec("layers.0.attn.qkv.bias", "bfloat16", (384,)),
    TensorSpec("layers.0.mlp.up.weight", "float16", (777, 333)),  # odd size: unaligned end
    TensorSpec("layers.0.norm.weight", "float32", (129,)),
    TensorSpec("layers.1.mlp.down.weight", "float32", (1000, 1001)),  # 4 MB: 4+ buckets
    TensorSpec("layers.1.norm.weight", "float32", (129,)),
    TensorSpec("head.weight", "bfloat16", (1024, 1000)),
    TensorSpec("step", "int64", (3,)),
]


def make_weights(seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = {}
    for s in SPECS:
        if s.dtype == "int64":
            t = torch.randint(-(2**62), 2**62, s.shape, generator=g, dtype=torch.int64)
        else:
            t = torch.randn(s.shape, generator=g).to(getattr(torch, s.dtype))
        out[s.name] = t.to(device)
    return out


def crcs(ws: dict[str, torch.Tensor]) -> dict[str, int]:
    return {n: zlib.crc32(t.detach().reshape(-1).view(torch.uint8).cpu().numpy())
            for n, t in ws.items()}


RECEIVER = r"""
import json, sys, zlib, torch
from torch import nn
from enginehooks.core.manifest import Manifest
from enginehooks.plugins import get_transport
from enginehooks.engine.targets import ModuleTarget

endpoint, rank, device = json.loads(sys.argv[1]), int(sys.argv[2]), torch.device(sys.argv[3])
manifests = [Manifest.from_json(m) for m in json.loads(sys.argv[4])]
torch.cuda.set_device(device)

def build(manifest):
    # An nn.Module tree with a zero parameter for every tensor of the update.
    root = nn.Module()
    for t in manifest.tensors:
        *path, leaf = t.name.split(".")
        mod = root
        for p in path:
            if not hasattr(mod, p):
                mod.add_module(p, nn.Module())
            mod = getattr(mod, p)
        dt = getattr(torch, t.dtype)
        mod.register_parameter(leaf, nn.Parameter(torch.zeros(t.shape, dtype=dt, device=device),
                                                  requires_grad=False))
    return root

model = build(manifests[0])
target = ModuleTarget(model)
if len(sys.argv) > 5 and sys.argv[5] == "nodest":
    target.destination = lambda name: None  # an engine target without destination()
receiver = get_transport(endpoint["transport"]).receiver(endpoint, rank, device)
receiver.connect()
for m in manifests:
    for p in model.parameters():
        p.data.zero_()
    if len(sys.argv) > 5 and sys.argv[5] == "stream":
        target.apply(receiver.stream(m, target.destination))  # no `deliver` (verl's way)
    else:
        receiver.deliver(m, target)
    torch.cuda.synchronize()
    out = {n: zlib.crc32(p.detach().reshape(-1).view(torch.uint8).cpu().numpy())
           for n, p in model.named_parameters()}
    print("RESULT " + json.dumps(out), flush=True)
receiver.close()
"""


def run_push(transport: str, receiver_devices: list[str], pushes: int = 3,
             mode: str = "dest", as_sent: Any = None, **options: object) -> None:
    """Push `pushes` versions (checksum none / sum64 / crc32 in turn) to receivers on
    `receiver_devices` and check every tensor of every push bit for bit. `as_sent(ws)`:
    the tensors as the stream yields them (same values)."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    sender = get_transport(transport).sender(host="127.0.0.1", port=0, timeout_s=60,
                                             device=device, **options)
    world = len(receiver_devices) + 1
    ep = dict(sender.endpoint(), world_size=world)
    checks = [None, "sum64", "crc32"]
    manifests = [plan(SPECS, weight_version=v, bucket_bytes=BUCKET, checksum=checks[v % 3])
                 for v in range(pushes)]
    assert len(manifests[0].buckets) >= 8
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RECEIVER, json.dumps(ep), str(r + 1), dev,
             json.dumps([m.to_json() for m in manifests]), mode],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        for r, dev in enumerate(receiver_devices)
    ]
    try:
        sender.connect(world)
        expected = []
        for v, m in enumerate(manifests):
            ws = make_weights(v, device)
            expected.append(crcs(ws))
            sent = as_sent(ws) if as_sent is not None else ws
            stats = sender.send(m, iter(sent.items()), Abort())
            assert stats.buckets == len(m.buckets)
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-4000:]
            results = [json.loads(line[7:]) for line in out.splitlines()
                       if line.startswith("RESULT ")]
            assert len(results) == pushes
            for v, got in enumerate(results):
                assert got == expected[v], f"push {v}: tensors differ"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        sender.close()


@gpus(2)
def test_nccl_two_gpus_bit_exact_several_pushes() -> None:
    run_push("nccl", ["cuda:1"])


@gpus(1)
def test_cuda_ipc_same_gpu_two_receivers_bit_exact_several_pushes() -> None:
    run_push("cuda_ipc", ["cuda:0", "cuda:0"])


@gpus(1)
def test_cuda_ipc_target_without_destination_bit_exact_several_pushes() -> None:
    """Single copy into a target that has no destination(): it copies from views of the
    trainer's memory itself; pushes 0-1 go by handle, push 2 (crc32) packed."""
    run_push("cuda_ipc", ["cuda:0"], mode="nodest")


@gpus(1)
def test_cuda_ipc_read_as_a_stream_ends_its_own_last_exchange() -> None:
    """A receiver read through `stream()` alone (verl's checkpoint engine, the
    multi-sender's parts), with no `deliver` to finish the update after the target's
    apply: the stream itself compares the sender's digests and sends the final ack
    (`CudaIpcReceiver._final`, inline). Without that the sender waits out its timeout
    and the push fails."""
    run_push("cuda_ipc", ["cuda:0"], mode="stream")


def awkward(ws: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same values as tensors single copy cannot read in place: a transposed
    (non-contiguous) one, one on the host, one 2 bytes off a 16-byte boundary."""
    out = dict(ws)
    t = ws["layers.0.mlp.up.weight"]
    out["layers.0.mlp.up.weight"] = t.t().contiguous().t()
    assert not out["layers.0.mlp.up.weight"].is_contiguous()
    out["layers.0.norm.weight"] = ws["layers.0.norm.weight"].cpu()
    q = ws["layers.0.attn.qkv.bias"]
    off = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)[1:]
    off.copy_(q)
    assert off.data_ptr() % 16
    out["layers.0.attn.qkv.bias"] = off
    return out


@gpus(1)
@pytest.mark.parametrize("window_tensors", [0, 2])
def test_cuda_ipc_single_copy_lands_sources_it_must_copy_first(window_tensors: int) -> None:
    """The sender checks a window's tensors as lists and reads them in place; a
    non-contiguous, host or misaligned one among them is copied first (`_sources`), in
    one doorbell or several (`window_tensors`), and every push lands bit for bit."""
    run_push("cuda_ipc", ["cuda:0"], as_sent=awkward, window_tensors=window_tensors)


@gpus(1)
def test_cuda_ipc_single_copy_refuses_a_stream_out_of_order_or_short() -> None:
    """A window's tensors checked as lists (`CudaIpcSender._sources`, called directly:
    a push needs receivers, and this is the check before anything is published): two
    tensors swapped fail the list check, and the check tensor by tensor names the first;
    a stream that ends inside the window names the tensor it lacks."""
    from enginehooks.core.errors import ManifestError

    device = torch.device("cuda", 0)
    sender = get_transport("cuda_ipc").sender(host="127.0.0.1", port=0, timeout_s=10,
                                              device=device)
    lay = _layout(plan(SPECS, weight_version=1, bucket_bytes=BUCKET, checksum="sum64"))
    items = list(make_weights(1, device).items())
    check = sender._sources  # type: ignore[attr-defined]
    try:
        assert len(check(lay, items[:4], 0, 4, device.index)) == 4
        swapped = [items[0], items[2], items[1], items[3]]
        with pytest.raises(ManifestError, match=(
                r"stream yielded 'layers\.0\.attn\.qkv\.bias' where the manifest expects "
                r"'layers\.0\.attn\.qkv\.weight'")):
            check(lay, swapped, 0, 4, device.index)
        with pytest.raises(ManifestError, match=(
                r"stream ended before tensor 'layers\.0\.mlp\.up\.weight' of the manifest")):
            check(lay, items[:3], 0, 4, device.index)
    finally:
        sender.close()


@gpus(1)
def test_cuda_ipc_two_buffers_fused_pack_bit_exact_several_pushes() -> None:
    """The two-buffer path (single_copy=False): the sender packs with the fused kernel
    (sum64 push), receivers check the plain sum64 of each bucket."""
    run_push("cuda_ipc", ["cuda:0"], single_copy=False)


@gpus(1)
def test_sum64_on_gpu_equals_the_cpu_value() -> None:
    from enginehooks.core.checksums import _sum64

    g = torch.Generator().manual_seed(3)
    for n in (1, 3, 4, 4099, (1 << 20) + 5, (64 << 20) + 2):
        buf = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        assert _sum64(buf.cuda()) == _sum64(buf), n


@gpus(2)
def test_cuda_ipc_refuses_a_receiver_on_another_gpu() -> None:
    from enginehooks.core.errors import TransportError
    from enginehooks.transports.cuda_ipc import CudaIpcReceiver

    r = CudaIpcReceiver({"transport": "cuda_ipc", "host": "127.0.0.1", "port": 1, "group": "g",
                         "timeout_s": 1, "world_size": 2}, 1, torch.device("cuda", 1))
    with pytest.raises(TransportError, match="use nccl between GPUs"):
        r._map({"gpu_uuid": "GPU-elsewhere", "pid": -1, "buffers": []})
