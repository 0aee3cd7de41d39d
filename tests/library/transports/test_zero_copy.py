"""Direct buckets (issue 20, part 1): a tensor that fills a bucket travels from its own
storage and lands straight in the receiver's parameter, with its digest still checked.

Real gloo groups and real `LocalEngine` replicas (torch modules) throughout; the only
fault injection is a byte flipped in the sender's payload after its digest was taken
(what a torn wire looks like to the receiver).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import pytest
import torch
from torch import nn

from enginehooks import EngineHooksError, WeightSync
from enginehooks.core.auth import AuthError
from enginehooks.core.buckets import (
    TRAILER_BYTES,
    Unpacker,
    manifest_id,
    message_bytes,
    pack,
    write_trailer,
)
from enginehooks.core.errors import ManifestError, TransportError
from enginehooks.core.manifest import DIRECT_FORMAT_VERSION, Manifest, TensorSpec, plan
from enginehooks.engine.local import LocalEngine
from enginehooks.engine.targets import ModuleTarget
from enginehooks.trainer_side import TrainerAdapter, adapter_for
from enginehooks.transports import broadcast
from enginehooks.transports.collectives import GlooTransport

BUCKET = 16 << 10


def net(seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Embedding 128 KiB (split into 8 direct buckets), a 16 KiB weight (fills one
    bucket: direct), and small tensors that are packed together."""
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Embedding(512, 64), nn.Linear(64, 64), nn.LayerNorm(64),
                      nn.Linear(64, 8))
    return m.to(dtype)


def manifest_of(model: nn.Module, dtype: str = "float32") -> Manifest:
    return plan([TensorSpec(n, dtype, tuple(t.shape)) for n, t in model.state_dict().items()],
                weight_version=1, bucket_bytes=BUCKET, direct_min=GlooTransport.direct_min)


def direct_names(m: Manifest) -> set[str]:
    return {t.name for t in m.tensors if t.pieces and m.buckets[t.pieces[0].bucket].direct}


def recording(target: ModuleTarget) -> dict[str, bool]:
    """Wrap `target.apply` to note, per tensor, whether what the receiver handed over
    is the parameter itself (landed in place) rather than a copy."""
    in_place: dict[str, bool] = {}
    apply = target.apply

    def wrapped(tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        def note() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in tensors:
                in_place[name] = t.data_ptr() == target.tensors[name].data_ptr()
                yield name, t

        apply(note())

    target.apply = wrapped  # type: ignore[method-assign]
    return in_place


def test_plan_gives_tensors_that_fill_a_bucket_direct_buckets_and_packs_the_rest() -> None:
    m = manifest_of(net(0))
    assert direct_names(m) == {"0.weight", "1.weight"}
    assert m.format_version == DIRECT_FORMAT_VERSION
    for b, pairs in zip(m.buckets, m.by_bucket()):
        if b.direct:  # one piece of one tensor, from offset 0, filling it
            assert len(pairs) == 1 and pairs[0][1].offset == 0 and pairs[0][1].nbytes == b.nbytes
    assert sum(b.direct for b in m.buckets) == 9 and any(not b.direct for b in m.buckets)
    # the flag survives the wire (it is what the trainer signs) and the id covers it
    again = Manifest.from_json(m.to_json())
    assert [b.direct for b in again.buckets] == [b.direct for b in m.buckets]
    packed = plan(m.specs(), weight_version=1, bucket_bytes=BUCKET)
    assert packed.format_version == 1 and not any(b.direct for b in packed.buckets)
    assert manifest_id(packed) != manifest_id(m)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(format_version=1), "need format_version 2"),
    (lambda d: d["buckets"][0].__setitem__(3, "packed"), r"expected \[index"),
    # a direct bucket that holds more than its one piece (the next tensor moved into it)
    (lambda d: d["tensors"][-1]["pieces"][0].__setitem__(0, 0), "direct but does not hold"),
])
def test_manifests_with_malformed_direct_buckets_are_refused(
        edit: Callable[[dict], None], message: str) -> None:
    d = manifest_of(net(0)).to_dict()
    assert d["buckets"][0][3] == "direct"
    edit(d)
    with pytest.raises(ManifestError, match=message):
        Manifest.from_dict(d)


def test_pack_sends_direct_buckets_from_the_tensors_own_storage() -> None:
    model = net(0)
    m = manifest_of(model)
    sd = model.state_dict()
    bufs = [torch.empty(message_bytes(BUCKET), dtype=torch.uint8) for _ in range(2)]
    storage = {n: (t.data_ptr(), t.data_ptr() + t.nbytes) for n, t in sd.items()}
    owners = {p.bucket: t.name for t in m.tensors for p in t.pieces}
    seen = 0
    for index, payload in pack(m, sd.items(), lambda i: bufs[i % 2]):
        lo, hi = storage[owners[index]]
        if m.buckets[index].direct:
            assert lo <= payload.data_ptr() < hi and payload.numel() == m.buckets[index].nbytes
        else:
            assert payload.data_ptr() == bufs[index % 2].data_ptr()
        seen += 1
    assert seen == len(m.buckets)


def test_direct_and_packed_buckets_arrive_bit_exact_and_direct_ones_in_place() -> None:
    trainer, replica = net(1), net(2)
    engine = LocalEngine(replica, name="r0")
    in_place = recording(engine.target)
    ptrs = {n: t.data_ptr() for n, t in replica.state_dict().items()}
    with WeightSync("gloo", timeout_s=20, bucket_bytes=BUCKET) as sync:
        sync.add_replica(engine)
        report = sync.push(trainer, version=1)
    assert report.buckets == len(manifest_of(trainer).buckets)
    assert engine.side.state == "current" and engine.side.version == 1
    for (n, a), b in zip(trainer.state_dict().items(), replica.state_dict().values()):
        assert torch.equal(a, b), n
    # received straight into the parameters, which stayed where they were
    assert {n for n, v in in_place.items() if v} == direct_names(manifest_of(trainer))
    assert {n: t.data_ptr() for n, t in replica.state_dict().items()} == ptrs


def test_a_wire_dtype_the_parameter_does_not_hold_is_received_in_a_buffer_and_cast() -> None:
    """float32 on the wire into a bfloat16 replica: the bytes cannot land in the
    parameter as they are, so they go to the transport's buffer (or the rejoin tensor of
    a split one) and the module's copy casts."""
    trainer, replica = net(3), net(4, torch.bfloat16)
    engine = LocalEngine(replica, name="r0")
    in_place = recording(engine.target)
    with WeightSync("gloo", timeout_s=20, bucket_bytes=BUCKET, dtype=torch.float32) as sync:
        sync.add_replica(engine)
        sync.push(trainer, version=1)
    assert engine.side.state == "current"
    assert in_place and not any(in_place.values())
    for (n, a), b in zip(trainer.state_dict().items(), replica.state_dict().values()):
        assert b.dtype == torch.bfloat16 and torch.equal(a.to(torch.bfloat16), b), n


def corrupting_pack(bucket: int) -> Callable[..., Iterator[tuple[int, torch.Tensor]]]:
    """`core.buckets.pack`, then one payload byte of `bucket` flipped after its digest
    and trailer were computed: for a direct bucket, in the trainer's own tensor, as the
    wire would tear it."""
    real = broadcast.pack

    def corrupt(manifest: Manifest, stream: Iterable[tuple[str, torch.Tensor]],
                next_buffer: Callable[[int], torch.Tensor], secret: bytes | None = None
                ) -> Iterator[tuple[int, torch.Tensor]]:
        for index, buf in real(manifest, stream, next_buffer, secret):
            if index == bucket:
                assert manifest.buckets[index].direct
                buf[5] ^= 0x5A
            yield index, buf

    return corrupt


@pytest.mark.parametrize("bucket", [1, 8])  # a piece of the embedding; the whole 1.weight
def test_a_corrupted_direct_bucket_is_refused_and_the_replica_is_never_current(
        monkeypatch: pytest.MonkeyPatch, bucket: int) -> None:
    """Protective line: `unpacker.verify_digest(index, payloads[slot], heads[slot])` on
    the landed path of `BroadcastReceiver.stream`. The bytes are already in the
    parameter when the digest fails: the update fails and the engine side marks the
    replica torn, so generation is refused until a good push."""
    monkeypatch.setattr(broadcast, "pack", corrupting_pack(bucket))
    trainer, replica = net(5), net(6)
    engine = LocalEngine(replica, name="r0")
    with WeightSync("gloo", timeout_s=20, bucket_bytes=BUCKET) as sync:
        sync.add_replica(engine)
        with pytest.raises(EngineHooksError, match=rf"r0.*bucket {bucket}: xxh3 0x"):
            sync.push(trainer, version=1)
        assert engine.side.state == "torn" and engine.side.version is None
        assert "ChecksumError" in (engine.side.last_error or "")
        assert engine.side.refusal() is not None
        monkeypatch.undo()
        sync.push(trainer, version=2)  # a good push repairs it
    assert engine.side.state == "current" and engine.side.version == 2
    for a, b in zip(trainer.state_dict().values(), replica.state_dict().values()):
        assert torch.equal(a, b)


class BreaksBefore(TrainerAdapter):
    """A trainer whose stream fails when it reaches tensor `at` (a rank lost its shard)."""

    name = "breaks-before"

    def __init__(self, model: nn.Module, at: str) -> None:
        super().__init__(model)
        self.inner, self.at = adapter_for(model), at

    @classmethod
    def accepts(cls, model: object) -> bool:
        return False

    def specs(self) -> list[TensorSpec]:
        return self.inner.specs()

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.inner.stream():
            if name == self.at:
                raise RuntimeError("trainer rank lost its shard")
            yield name, t


def test_an_abort_before_a_direct_bucket_reaches_the_replica_and_lands_nowhere() -> None:
    """The abort notice of a direct bucket is its trailer (checked before any payload
    receive is posted) and the reason after it: the replica hears why, and the
    parameter the bucket was headed for is untouched."""
    trainer, replica = net(7), net(8)
    before = replica[1].weight.detach().clone()
    engine = LocalEngine(replica, name="r0")
    with WeightSync("gloo", timeout_s=20, bucket_bytes=BUCKET) as sync:
        sync.add_replica(engine)
        with pytest.raises((RuntimeError, EngineHooksError), match="lost its shard"):
            sync.push(BreaksBefore(trainer, "1.weight"), version=1)
    assert engine.side.state == "torn"
    assert "SenderAborted" in (engine.side.last_error or "")
    assert "lost its shard" in (engine.side.last_error or "")
    assert torch.equal(replica[1].weight.detach(), before)
    assert torch.equal(replica[0].weight.detach(), trainer[0].weight.detach())


def test_a_direct_trailer_of_another_update_or_signer_is_refused_before_landing() -> None:
    m, other = manifest_of(net(0)), manifest_of(net(0), dtype="bfloat16")
    head = torch.zeros(TRAILER_BYTES, dtype=torch.uint8)
    write_trailer(head, mid=manifest_id(other), index=0, nbytes=m.buckets[0].nbytes, dig=1)
    with pytest.raises(TransportError, match="another update"):
        Unpacker(m).check_header(0, head)
    write_trailer(head, mid=manifest_id(m), index=0, nbytes=m.buckets[0].nbytes, dig=1,
                  secret=b"a" * 32)
    assert Unpacker(m, secret=b"a" * 32).check_header(0, head) == -1
    with pytest.raises(AuthError, match="not signed"):
        Unpacker(m, secret=b"b" * 32).check_header(0, head)
