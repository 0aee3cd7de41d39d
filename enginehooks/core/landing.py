"""What a receiver tells verification about bytes it landed itself (`WireLanding`).

Verification proves a planned plain copy by re-reading its destination after the
engine's load and post-processing (`engine/verify.py` `DigestCheck`). A receiver that
copies pieces straight into the target's tensors in a pass that also digests them (the
fused landing, `core/fused_copy.py`: `cuda_ipc`'s single copy, a packed NCCL bucket)
has the digest of what it landed already; this record hands it over, so that nothing is
digested per tensor while the update streams.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class WireLanding:
    """Pieces a receiver copied straight into the target's own tensors in one pass that
    also digested what it read: `sums[k]` is the sum of those pieces' `sum64` terms in
    bucket k, at their word offsets in the bucket (the receiver checked these plus the
    rest of each bucket against the sender's digest, so they are the sender's bytes).

    Why: verification proves a planned plain copy by re-reading its destination after
    the engine's load and post-processing, and comparing with a digest of what was
    received (`engine.verify.DigestCheck`). Where the receiver landed the bytes itself,
    that digest is already in `sums`: re-reading the same destinations with the same
    weights (one launch of `core/fused_copy.py` over every landing of the update, digest
    only) must give `sums` again, with no digest per tensor while the update streams (on
    a GPU each is a kernel launch: ~75 us, most of what verification added to a 1 GB
    push). A bucket whose re-read differs names all its landed tensors (the check cannot
    tell which one changed)."""

    #: per bucket, the landed pieces' terms (int64 device vector; wraps mod 2**64)
    sums: torch.Tensor
    #: landed tensor name -> (destination address, bytes landed in this record)
    names: dict[str, tuple[int, int]]
    #: bucket -> the names with a piece landed in it
    by_bucket: dict[int, list[str]]
    #: the pieces (int64 arrays of one length): destination address, bytes, word offset
    #: in the bucket, and the index in `sums` each is added into
    dst: Any
    nbytes: Any
    word: Any
    bucket: Any


__all__ = ["WireLanding"]
