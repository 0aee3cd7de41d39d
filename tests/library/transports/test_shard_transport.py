"""The `shard` transport (`transports/shard_direct.py`: `ShardSender`, `ShardReceiver`,
issue 40) in one process: two senders' gloo groups and two engine workers, each half on
a thread of its own, as `WeightSync("shard", senders=...)` forms them
(tests/multihost/test_shard_direct_sync.py drives the same through the API, between
processes).

- A scheduled manifest: each sender sends only its transfers, from its own bytes (the
  stream is never started); each worker's target gets every tensor it was sent, its
  bytes where the schedule put them.
- A byte changed after its range was digested: `ChecksumError` naming tensor, range and
  sender, and nothing reaches the target.
- A manifest without a schedule is broadcast over the same groups.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import enginehooks.transports.shard_direct as sd
from enginehooks.core.errors import ChecksumError
from enginehooks.core.manifest import Manifest, TensorSpec, plan
from enginehooks.core.schedule import Transfer
from enginehooks.plugins import get_transport
from enginehooks.transports.base import Abort, Target
from enginehooks.transports.shard_direct import ShardReceiver, ShardSender, ShardStream
from enginehooks.wire.schedule import ShardSchedule

TIMEOUT_S = 30.0
FULL = {"a": torch.arange(16, dtype=torch.float32), "b": torch.arange(8, dtype=torch.float32) * -1}
SPECS = [TensorSpec(n, "float32", tuple(t.shape)) for n, t in FULL.items()]
# worker 0 reads the first half of each tensor, worker 1 the second; sender j holds half j
TRANSFERS = (Transfer(0, 0, "a", 0, 32), Transfer(1, 1, "a", 32, 64),
             Transfer(0, 0, "b", 0, 16), Transfer(1, 1, "b", 16, 32))


class Held:
    """Sender `rank`'s own bytes: half `rank` of each tensor."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def source(self, t: Transfer) -> torch.Tensor:
        raw = FULL[t.name].reshape(-1).view(torch.uint8)
        half = raw.numel() // 2
        assert self.rank * half <= t.start and t.stop <= (self.rank + 1) * half
        return raw[t.start: t.stop]


class Kept(Target):
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.got: dict[str, torch.Tensor] | None = None

    def apply(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.got = {n: t.clone() for n, t in tensors}


def _all(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run every call on a thread of its own; their results or exceptions, in order."""
    out: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except BaseException as e:
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 2)
    assert not any(t.is_alive() for t in threads), "a half did not return"
    return out


@pytest.fixture
def groups() -> Iterator[tuple[list[ShardSender], list[ShardReceiver]]]:
    senders = [ShardSender(host="127.0.0.1", port=0, timeout_s=TIMEOUT_S) for _ in range(2)]
    eps = [s.endpoint() for s in senders]
    assert {e["transport"] for e in eps} == {"shard"}
    endpoint = {**eps[0], "group": f"multi-{eps[0]['group']}", "senders": eps,
                "world_size": 3}
    receivers = [get_transport("shard").receiver(dict(endpoint), 1 + e, torch.device("cpu"))
                 for e in range(2)]
    assert all(isinstance(r, ShardReceiver) for r in receivers)
    _all([lambda s=s: s.connect(3) for s in senders]  # type: ignore[misc]
         + [r.connect for r in receivers])
    yield senders, receivers  # type: ignore[misc]
    for r in receivers:
        r.close()
    for s in senders:
        s.close()


def _push(senders: list[ShardSender], receivers: list[ShardReceiver], manifest: Manifest,
          stream: Callable[[int], Any]) -> tuple[list[Any], list[Kept]]:
    targets = [Kept(), Kept()]
    out = _all([lambda j=j: senders[j].send(manifest, stream(j), Abort()) for j in range(2)]
               + [lambda e=e: receivers[e].deliver(manifest, targets[e]) for e in range(2)])
    return out, targets


def scheduled() -> Manifest:
    return plan(SPECS, weight_version=1, bucket_bytes=1 << 20, checksum="xxh3",
                meta=ShardSchedule(2, 2, TRANSFERS).into({}))


def _unstarted(j: int) -> ShardStream:
    def never() -> Iterator[tuple[str, torch.Tensor]]:
        raise AssertionError("a scheduled push started the stream (a gather)")
    return ShardStream(never, lambda: Held(j))


def test_each_sender_sends_its_own_transfers_and_each_worker_gets_its_bytes(
        groups: tuple[list[ShardSender], list[ShardReceiver]]) -> None:
    senders, receivers = groups
    out, targets = _push(senders, receivers, scheduled(), _unstarted)
    assert not [o for o in out if isinstance(o, BaseException)], out
    assert [o.bytes for o in out[:2]] == [48, 48]
    assert [o["schedule"]["received"] for o in out[2:]] == [48, 48]
    for e, target in enumerate(targets):
        assert target.got is not None and set(target.got) == {"a", "b"}
        for name, t in target.got.items():
            half = t.numel() // 2
            mine = slice(e * half, (e + 1) * half)
            assert torch.equal(t[mine], FULL[name][mine])  # its bytes, where they belong
            assert not t[slice(0, half) if e else slice(half, None)].any()  # nothing else


def test_a_byte_changed_after_its_digest_is_refused_before_the_target_sees_anything(
        groups: tuple[list[ShardSender], list[ShardReceiver]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    senders, receivers = groups
    seal = sd._seal

    def late_flip(key: Any, mid: int, index: int, buf: torch.Tensor, checksum: Any
                  ) -> tuple[int, int]:
        sealed = seal(key, mid, index, buf, checksum)
        if index == 1:  # sender 1's range of "a", after its digest
            buf[0] ^= 0xFF
        return sealed

    monkeypatch.setattr(sd, "_seal", late_flip)
    saved = FULL["a"].clone()
    try:
        out, targets = _push(senders, receivers, scheduled(), _unstarted)
    finally:
        FULL["a"].copy_(saved)
    assert isinstance(out[3], ChecksumError), out
    assert "bytes [32, 64) of 'a' from trainer rank 1" in str(out[3])
    assert targets[1].got is None  # nothing applied
    assert out[2]["schedule"]["received"] == 48 and targets[0].got is not None


def test_a_manifest_without_a_schedule_is_broadcast_over_the_same_groups(
        groups: tuple[list[ShardSender], list[ShardReceiver]]) -> None:
    from enginehooks.core.senders import decide_parts, parts

    senders, receivers = groups
    manifest = plan(parts=decide_parts([SPECS, SPECS]), weight_version=1,
                    bucket_bytes=1 << 20, checksum="xxh3", meta={"schedule_off": "test"})
    mine = parts(manifest)
    targets = [Kept(), Kept()]
    out = _all([lambda j=j: senders[j].send(mine[j], iter(
                    [(t.name, FULL[t.name]) for t in mine[j].tensors]), Abort())
                for j in range(2)]
               + [lambda e=e: receivers[e].deliver(manifest, targets[e]) for e in range(2)])
    assert not [o for o in out if isinstance(o, BaseException)], out
    assert out[0].extra["schedule"] == "off: test"
    for target in targets:
        assert target.got is not None
        assert all(torch.equal(target.got[n], FULL[n]) for n in FULL)


# worker 0 is sent "a" whole (half from each sender) and half of "b"; worker 1 half of "b"
WHOLE_A = (Transfer(0, 0, "a", 0, 32), Transfer(1, 0, "a", 32, 64),
           Transfer(0, 0, "b", 0, 16), Transfer(1, 1, "b", 16, 32))


class Live(Target):
    """A target holding "a" as a planned plain copy (`destination`, as `ApplyTarget`
    answers inside its `apply`): what it is given, and whether "a" came as its own
    tensor. `fail`: its apply raises before it pulls a tensor."""

    device = torch.device("cpu")

    def __init__(self, fail: bool = False) -> None:
        self.live = {"a": torch.full((16,), -7.0)}
        self.got: dict[str, torch.Tensor] | None = None
        self.same: dict[str, bool] = {}
        self.fail = fail
        self.session = False

    def destination(self, name: str) -> torch.Tensor | None:
        return self.live.get(name) if self.session else None

    def apply(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        if self.fail:
            raise RuntimeError("the engine is not ready")
        self.session = True
        try:
            got = dict(tensors)
        finally:
            self.session = False
        self.same = {n: t.data_ptr() == self.live[n].data_ptr()
                     for n, t in got.items() if n in self.live}
        self.got = {n: t.clone() for n, t in got.items()}


def test_a_tensor_sent_whole_lands_in_the_targets_own_tensor(
        groups: tuple[list[ShardSender], list[ShardReceiver]]) -> None:
    """Worker 0 is sent all of "a": it receives it straight into the tensor the target
    holds (`Target.destinations`, asked inside the target's `apply`), which the target
    is then given as itself (nothing staged, nothing copied); half of "b" is staged."""
    senders, receivers = groups
    manifest = plan(SPECS, weight_version=1, bucket_bytes=1 << 20, checksum="xxh3",
                    meta=ShardSchedule(2, 2, WHOLE_A).into({}))
    targets = [Live(), Live()]
    out = _all([lambda j=j: senders[j].send(manifest, _unstarted(j), Abort()) for j in range(2)]
               + [lambda e=e: receivers[e].deliver(manifest, targets[e]) for e in range(2)])
    assert not any(isinstance(o, BaseException) for o in out), out
    assert torch.equal(targets[0].live["a"], FULL["a"])
    assert targets[0].same == {"a": True} and out[2]["schedule"]["in_place"] == 1
    assert targets[0].got is not None and torch.equal(targets[0].got["b"][:4], FULL["b"][:4])
    # worker 1 holds "a" too but is sent none of it: its tensor is untouched
    assert out[3]["schedule"]["in_place"] == 0 and torch.equal(
        targets[1].live["a"], torch.full((16,), -7.0))


def test_a_bad_byte_landed_in_place_is_refused_before_the_target_gets_a_tensor(
        groups: tuple[list[ShardSender], list[ShardReceiver]]) -> None:
    senders, receivers = groups
    manifest = plan(SPECS, weight_version=1, bucket_bytes=1 << 20, checksum="xxh3",
                    meta=ShardSchedule(2, 2, WHOLE_A).into({}))
    seal = sd._outgoing

    def flip(dst: int, msgs: Any, bufs: list[torch.Tensor], seals: Any) -> list[torch.Tensor]:
        bufs = seal(dst, msgs, bufs, seals)
        if dst == 0:  # a copy: the sender's own bytes stay as they are
            bufs = list(bufs)
            bufs[0] = bufs[0].clone()
            bufs[0][0] ^= 0xFF
        return bufs

    targets = [Live(), Live()]
    sd._outgoing = flip  # type: ignore[assignment]
    try:
        out = _all([lambda j=j: senders[j].send(manifest, _unstarted(j), Abort())
                    for j in range(2)]
                   + [lambda e=e: receivers[e].deliver(manifest, targets[e]) for e in range(2)])
    finally:
        sd._outgoing = seal  # type: ignore[assignment]
    assert isinstance(out[2], ChecksumError), out
    assert targets[0].got is None  # the target's apply got no tensor
    assert not isinstance(out[3], BaseException) and targets[1].got is not None


def test_a_target_that_fails_before_pulling_still_lets_the_senders_finish(
        groups: tuple[list[ShardSender], list[ShardReceiver]]) -> None:
    """The worker's target raises before it pulls a tensor: the worker still receives
    its ranges (thrown away) so the senders finish at once instead of waiting out their
    timeout; the target's own error reaches the caller."""
    import time

    senders, receivers = groups
    manifest = plan(SPECS, weight_version=1, bucket_bytes=1 << 20, checksum="xxh3",
                    meta=ShardSchedule(2, 2, WHOLE_A).into({}))
    targets = [Live(fail=True), Live()]
    t0 = time.monotonic()
    out = _all([lambda j=j: senders[j].send(manifest, _unstarted(j), Abort()) for j in range(2)]
               + [lambda e=e: receivers[e].deliver(manifest, targets[e]) for e in range(2)])
    assert isinstance(out[2], RuntimeError) and "not ready" in str(out[2]), out
    assert not isinstance(out[0], BaseException) and not isinstance(out[1], BaseException), out
    assert not isinstance(out[3], BaseException), out
    assert time.monotonic() - t0 < TIMEOUT_S / 2
    assert torch.equal(targets[0].live["a"], torch.full((16,), -7.0))  # nothing landed there
