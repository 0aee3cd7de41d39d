"""`DigestCheck`'s use of a receiver's landings (`core/landing.py`), the parts that need
no GPU: which received tensors a landing proves (all of them, at the address it landed
them), and a destination that is no longer at that address. The re-read itself is a
CUDA launch (`tests/gpu/test_wire_landing_gpu.py` runs it on the device)."""

from __future__ import annotations

import numpy as np
import torch

from enginehooks.core.landing import WireLanding
from enginehooks.engine.copy_plan import Step, View
from enginehooks.engine.verify import DigestCheck


def landing(t: torch.Tensor, nbytes: int) -> WireLanding:
    """`nbytes` of `t` landed by a receiver at `t`'s address, in bucket 0."""
    return WireLanding(torch.zeros(1, dtype=torch.int64), {"w": (t.data_ptr(), nbytes)},
                       {0: ["w"]}, np.array([t.data_ptr()]), np.array([nbytes]),
                       np.array([0]), np.array([0]))


def full(t: torch.Tensor) -> list[Step]:
    v = View(0, tuple(t.shape), tuple(t.stride()))
    return [Step("w", v, v)]


def test_a_tensor_landed_in_part_is_digested_as_it_arrives() -> None:
    """Without the byte count in `DigestCheck.add`, half a landing would prove the
    whole tensor, and the re-read would never look at the other half."""
    t = torch.arange(64, dtype=torch.float32)
    check = DigestCheck()
    check.wire(landing(t, t.nbytes // 2))
    check.add(full(t), t, {"w": torch.float32}, "w")
    assert [r[2] for r in check.runs["w"]] != ["landed"]
    assert check.landed_dests() == set()
    good, bad = check.check({"w": t})
    assert good == ["w"] and bad == []


def test_a_whole_landing_proves_the_tensor_and_a_moved_destination_is_bad() -> None:
    """Landed whole: nothing is digested as it arrives. A destination the engine replaced
    after the landing (another tensor object, another address) is bad, not proved by
    bytes that now live elsewhere (the address check in `DigestCheck.check`)."""
    t = torch.arange(64, dtype=torch.float32)
    check = DigestCheck()
    check.wire(landing(t, t.nbytes))
    check.add(full(t), t, {"w": torch.float32}, "w")
    assert [r[2] for r in check.runs["w"]] == ["landed"]
    assert check.landed_dests() == {"w"}
    good, bad = check.check({"w": t.clone()})
    assert good == [] and bad == ["w"]


def test_a_tensor_landed_at_two_addresses_is_not_proved_by_either() -> None:
    t = torch.arange(64, dtype=torch.float32)
    other = torch.zeros(64)
    check = DigestCheck()
    check.wire(landing(t, t.nbytes // 2))
    check.wire(landing(other, t.nbytes // 2))
    check.add(full(t), t, {"w": torch.float32}, "w")
    assert check.landed_dests() == set()
