"""Verification's digests of planned plain copies on a GPU (engine/verify.py
`DigestCheck`, issue 38): the received bytes' digests stay on the device as they arrive
(no host sync per tensor) and are compared in one batch after apply. The batch must
still name every destination whose bytes changed after landing, including runs that
start at an odd element (not 4-byte aligned) and runs whose length is not a multiple of
4 bytes."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_gpu
def test_device_digests_prove_copies_and_name_a_byte_changed_after_landing() -> None:
    from enginehooks.core import fused_copy
    from enginehooks.engine.copy_plan import Step, View
    from enginehooks.engine.verify import DigestCheck

    dev = torch.device("cuda", 0)
    if not fused_copy.available(dev):
        pytest.skip("the fused kernel does not run here (no Triton)")
    bf16 = torch.bfloat16
    q = torch.randn(3, 5, device=dev).to(bf16)  # 30 bytes: not a whole number of words
    k = torch.randn(3, 5, device=dev).to(bf16)  # lands at element 15: byte 30, 2-aligned
    w = torch.randn(1000, 64, device=dev).to(bf16)
    live = {"qkv": torch.zeros(6, 5, device=dev, dtype=bf16),
            "w": torch.zeros(1000, 64, device=dev, dtype=bf16)}
    steps = {"q": [Step("qkv", View(0, (3, 5), (5, 1)), View(0, (3, 5), (5, 1)))],
             "k": [Step("qkv", View(15, (3, 5), (5, 1)), View(0, (3, 5), (5, 1)))],
             "w": [Step("w", View(0, (1000, 64), (64, 1)), View(0, (1000, 64), (64, 1)))]}
    dtypes = {"qkv": bf16, "w": bf16}
    live["qkv"][:3].copy_(q)
    live["qkv"][3:].copy_(k)
    live["w"].copy_(w)
    check = DigestCheck()
    for name, t in (("q", q), ("k", k), ("w", w)):
        check.add(steps[name], t, dtypes)
    # every received run was digested on the device, without a sync (k's destination
    # run is 2-byte aligned: the check reads it through an aligned copy)
    assert all(isinstance(r[3], torch.Tensor) for runs in check.runs.values() for r in runs)
    good, bad = check.check(live)
    assert sorted(good) == ["qkv", "w"] and bad == []
    # one byte changed after landing, in the big run and in the odd-aligned one
    live["w"].view(-1).view(torch.uint8)[123457] ^= 1
    good, bad = check.check(live)
    assert bad == ["w"] and good == ["qkv"]
    live["w"].copy_(w)
    live["qkv"].view(-1)[29] += 1.0  # k's last element
    good, bad = check.check(live)
    assert bad == ["qkv"] and good == ["w"]


@needs_gpu
def test_sum64_into_adds_the_same_term_as_sum64_tensor_into_its_slot() -> None:
    from enginehooks.core.checksums import sum64_into, sum64_tensor

    dev = torch.device("cuda", 0)
    g = torch.Generator(device="cpu").manual_seed(7)
    raw = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=g).to(dev)
    out = torch.zeros(8, dtype=torch.int64, device=dev)
    # whole words, a ragged tail, an odd start (read through an aligned copy), empty
    runs = [raw[:1 << 20], raw[5:(1 << 20) + 12], raw[3:4], raw[:0], raw]
    for k, b in enumerate(runs):
        sum64_into(b, out, k + 1)
    want = [0] + [int(sum64_tensor(b)) for b in runs] + [0, 0]
    assert out.tolist() == want
