"""`timeout_s` bounds the engine's whole receive, not each bucket.

A link that turns slow after a push started (latency jumping to seconds, issue 27) can
deliver every bucket within the timeout and still take far longer than it in total; a
per-bucket bound then keeps the engine `updating` until `timeout_s` after the last byte
that trickled in. Real gloo group, real sender and receiver; the slow link is a trainer
stream that yields each tensor late (each within the timeout).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from enginehooks.core.errors import TransportError
from enginehooks.core.manifest import TensorSpec, plan
from enginehooks.transports.base import Abort
from enginehooks.transports.collectives import GlooTransport

TIMEOUT_S = 2.0
PER_TENSOR_S = 0.5  # well within the timeout, each time
TENSORS = {f"t{i}": torch.full((1024,), float(i)) for i in range(10)}  # 5 s in all


def slow() -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in TENSORS.items():
        time.sleep(PER_TENSOR_S)
        yield name, t


def test_a_receive_slower_than_timeout_s_in_all_ends_at_timeout_s() -> None:
    manifest = plan([TensorSpec(n, "float32", tuple(t.shape)) for n, t in TENSORS.items()],
                    weight_version=1, bucket_bytes=4096)
    assert len(manifest.buckets) == len(TENSORS)  # one bucket per tensor: each arrives late
    gloo = GlooTransport()
    sender = gloo.sender(timeout_s=TIMEOUT_S)
    endpoint = dict(sender.endpoint(), world_size=2)  # what the join carries
    receiver = gloo.receiver(endpoint, 1, torch.device("cpu"))
    joined = threading.Thread(target=receiver.connect, daemon=True)
    joined.start()
    sender.connect(2)
    joined.join(30)
    outcome: dict[str, Any] = {}

    def receive() -> None:
        t0 = time.monotonic()
        try:
            outcome["received"] = [name for name, _ in receiver.stream(manifest)]
        except TransportError as e:
            outcome["error"] = e
        outcome["seconds"] = time.monotonic() - t0

    rx = threading.Thread(target=receive, daemon=True)
    rx.start()
    abort = Abort()
    # the receiver leaves the group at its deadline: the sender's part may fail too
    with contextlib.suppress(Exception):
        sender.send(manifest, slow(), abort)
    rx.join(TIMEOUT_S + 30)
    try:
        assert not rx.is_alive(), "the receiver did not end"
        assert "error" in outcome, (
            f"the receiver took all {len(outcome.get('received', []))} tensors in "
            f"{outcome.get('seconds', 0):.1f}s, past timeout_s={TIMEOUT_S}")
        assert "within 2s (timeout_s bounds the whole transfer" in str(outcome["error"])
        assert outcome["seconds"] <= TIMEOUT_S + 1.0, outcome
    finally:
        sender.close()
        receiver.close()


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
