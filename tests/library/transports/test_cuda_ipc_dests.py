"""Where the `cuda_ipc` engine lands each tensor (`cuda_ipc._Dests`), on the host: the
rule alone, with host tensors standing for the GPU's (the receiver's device here is the
CPU, so a destination "on this device" is a host tensor). A destination is used only
where the bytes can land as they are: the planned dtype and shape, contiguous, 4-byte
aligned, on the receiver's device. Anything else lands in a tensor of the receiver's
own (a tensor cut across buckets) or is handed to the target as a view, and the target
copies it itself. The landing bit for bit runs on a GPU (`tests/gpu/`)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from enginehooks.core.manifest import TensorSpec, plan
from enginehooks.transports.cuda_ipc import _Dests, _layout

SPECS = [TensorSpec("a", "float16", (4, 8)), TensorSpec("b", "float16", (16,)),
         TensorSpec("big", "float32", (600,)),  # 2400 bytes: cut across 1 KiB buckets
         TensorSpec("c", "bfloat16", (3, 5)), TensorSpec("d", "float32", (7,)),
         TensorSpec("e", "float16", (2, 2))]


def layout() -> object:
    return _layout(plan(SPECS, weight_version=1, bucket_bytes=1024, checksum="sum64"))


def good() -> dict[str, torch.Tensor]:
    return {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in SPECS}


def resolved(dests: dict[str, torch.Tensor | None]) -> tuple[_Dests, dict[str, tuple[bool, bool]]]:
    lay = layout()

    def into(names: Sequence[str]) -> list[torch.Tensor | None]:
        return [dests.get(n) for n in names]

    res = _Dests(lay, into, torch.device("cpu"))  # type: ignore[arg-type]
    res.through(len(lay.starts_in))  # type: ignore[attr-defined]
    names = [e.name for e in lay.tensors]  # type: ignore[attr-defined]
    return res, {n: (bool(res.has[i]), bool(res.lazy[i])) for i, n in enumerate(names)}


def test_every_fitting_destination_is_used_at_its_address() -> None:
    dests = good()
    res, flags = resolved(dict(dests))
    assert all(has and not lazy for has, lazy in flags.values()), flags
    for i, e in enumerate(layout().tensors):  # type: ignore[attr-defined]
        assert res.dests[i] is dests[e.name]
        assert res.dptr[i] == dests[e.name].data_ptr()


DEFECTS = {
    "dtype": ("a", lambda: torch.zeros(4, 8, dtype=torch.float32)),
    "shape": ("big", lambda: torch.zeros(601, dtype=torch.float32)),
    "strides": ("c", lambda: torch.zeros(5, 3, dtype=torch.bfloat16).t()),
    "alignment": ("e", lambda: torch.zeros(5, dtype=torch.float16)[1:].view(2, 2)),
}


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_one_destination_that_does_not_fit_among_fitting_ones(defect: str) -> None:
    """One defect alone: the check of the whole batch must see it (else every
    destination of the batch is taken as it is)."""
    name, make = DEFECTS[defect]
    dests: dict[str, torch.Tensor | None] = good()
    dests[name] = make()
    _, flags = resolved(dests)
    assert flags[name] == (False, name == "big"), flags  # "big" is cut: a tensor of its own
    assert all(f == (True, False) for n, f in flags.items() if n != name), flags


def test_destinations_that_do_not_fit_are_not_landed_in() -> None:
    dests: dict[str, torch.Tensor | None] = good()
    dests["a"] = torch.zeros(4, 8, dtype=torch.float32)  # another dtype
    dests["b"] = torch.zeros(17, dtype=torch.float16)[:16].reshape(16)  # fits
    dests["c"] = torch.zeros(5, 3, dtype=torch.bfloat16).t()  # not contiguous
    dests["d"] = torch.zeros(8, dtype=torch.float32)[:7].view(7)  # fits
    dests["e"] = torch.zeros(5, dtype=torch.float16)[1:].view(2, 2)  # 2 bytes off
    dests["big"] = torch.zeros(601, dtype=torch.float32)  # another shape
    _, flags = resolved(dests)
    assert flags == {"a": (False, False), "b": (True, False), "big": (False, True),
                     "c": (False, False), "d": (True, False), "e": (False, False)}, flags


def test_a_missing_destination_is_not_landed_in() -> None:
    dests: dict[str, torch.Tensor | None] = good()
    dests["big"] = None
    del dests["c"]
    _, flags = resolved(dests)
    assert flags["big"] == (False, True) and flags["c"] == (False, False)
    assert all(flags[n] == (True, False) for n in ("a", "b", "d", "e"))


def test_resolving_ahead_stops_when_told_and_resumes_where_it_stopped() -> None:
    lay = layout()
    asked: list[list[str]] = []
    dests = good()

    def into(names: Sequence[str]) -> list[torch.Tensor | None]:
        asked.append(list(names))
        return [dests.get(n) for n in names]

    res = _Dests(lay, into, torch.device("cpu"))  # type: ignore[arg-type]
    res.CHUNK = 1
    looks = iter([False, True])
    res.ahead(lambda: next(looks))
    assert len(asked) == 1 and not res.done  # one chunk, then told to stop
    res.through(len(lay.starts_in))  # type: ignore[attr-defined]
    assert res.done and [n for a in asked for n in a] == [s.name for s in SPECS]
    res.restart()
    assert not res.has.any() and all(d is None for d in res.dests) and res.upto == 0


# -- the landing description (`CudaIpcReceiver._landing`) --------------------------------
def test_a_landing_description_is_given_again_only_for_the_same_pieces() -> None:
    """A window that lands the same pieces at the same addresses as the last push gets
    the last description again (the same names and arrays, no loop over the pieces),
    with this push's sums; a piece landed anywhere else, or another layout, gets
    a description of its own. Protective line: the column comparison in `_landing`
    (without it a moved destination is described at its old address, and verification
    re-reads memory the push did not write)."""
    import numpy as np

    from enginehooks.transports.cuda_ipc import CudaIpcReceiver

    recv = object.__new__(CudaIpcReceiver)  # only the description's state: no store, no GPU
    recv._landings = {}
    lay = layout()
    i64 = lambda *v: np.array(v, dtype=np.int64)  # noqa: E731
    t_idx, base, nb, wd, bk = i64(0, 1), i64(4096, 8192), i64(64, 32), i64(0, 16), i64(0, 0)
    sums = [torch.zeros(2, dtype=torch.int64) for _ in range(3)]
    first = recv._landing(0, sums[0], lay, t_idx, base, base.copy(), nb, wd, bk)
    assert first.names == {"a": (4096, 64), "b": (8192, 32)}
    assert first.by_bucket == {0: ["a", "b"]}
    again = recv._landing(0, sums[1], lay, t_idx.copy(), base.copy(), base.copy(), nb.copy(),
                          wd.copy(), bk.copy())
    assert again.sums is sums[1] and again.names is first.names and again.dst is first.dst
    moved = base.copy()
    moved[1] = 12288  # "b" landed elsewhere this push
    other = recv._landing(0, sums[2], lay, t_idx, moved, moved, nb, wd, bk)
    assert other.names == {"a": (4096, 64), "b": (12288, 32)}
    assert list(other.dst) == [4096, 12288]
    fresh = recv._landing(0, sums[2], layout(), t_idx, moved, moved, nb, wd, bk)
    assert fresh.names == other.names and fresh.names is not other.names
