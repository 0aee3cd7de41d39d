"""The `shm` colocated transport on CPU: sender in the test process, receivers on threads.

Threads are enough for `shm`: each receiver maps the files through its own
`torch.from_file` mapping and talks to the sender only through the TCPStore, exactly
as an engine worker in another process would. One test also runs a receiver in a
subprocess, and one drives the whole `WeightSync` through an in-process engine side.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from enginehooks.control._futures import spawn
from enginehooks.control.sync import WeightSync
from enginehooks.core.buckets import TRAILER_BYTES
from enginehooks.core.errors import ChecksumError, SenderAborted, TransportError
from enginehooks.core.manifest import Manifest, TensorSpec, plan
from enginehooks.engine.local import LocalEngine
from enginehooks.transports.base import Abort, Target
from enginehooks.transports.shm import ShmSender, ShmTransport

BUCKET = 4096
SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this host")


def weights(seed: int) -> dict[str, torch.Tensor]:
    """Mixed dtypes, odd sizes (unaligned ends), and tensors larger than a bucket."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(40, 33, generator=g).to(torch.bfloat16),  # 2640 B
        "big.weight": torch.randn(3000, generator=g),  # 12000 B: three buckets
        "norm.weight": torch.randn(7, generator=g).to(torch.float16),
        "ids": torch.randint(-(2**62), 2**62, (65,), generator=g, dtype=torch.int64),
        "huge.bf16": torch.randn(5000, generator=g).to(torch.bfloat16),  # 10000 B
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5, dtype=torch.float32),
    }


def specs(ws: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [
        TensorSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in ws.items()
    ]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


class DictTarget(Target):
    """Keeps a private copy of every tensor it receives (views die with the bucket)."""

    device = torch.device("cpu")

    def __init__(self, hold: threading.Event | None = None) -> None:
        self.got: dict[str, torch.Tensor] = {}
        self.hold = hold

    def apply(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.got = {}
        for name, t in tensors:
            if self.hold is not None:
                self.hold.wait(30)
            self.got[name] = t.clone()


class Group:
    """A sender and `n` thread-hosted receivers joined on one shm group."""

    def __init__(self, n: int = 1, timeout_s: float = 5.0, sender_cls: type = ShmSender) -> None:
        self.sender = sender_cls(host="127.0.0.1", port=0, timeout_s=timeout_s)
        self.endpoint = json.loads(json.dumps(dict(self.sender.endpoint(), world_size=n + 1)))
        t = ShmTransport()
        cpu = torch.device("cpu")
        self.receivers = [t.receiver(self.endpoint, r, cpu) for r in range(1, n + 1)]
        for r in self.receivers:
            r.connect()
        self.sender.connect(n + 1)

    def files(self) -> list[str]:
        return sorted(p.name for p in SHM.glob(f"enginehooks-{self.sender.group_id}-*"))

    def push(
        self, ws: dict[str, torch.Tensor], version: int, targets: list[Any],
        checksum: str | None = "crc32", abort: Abort | None = None,
    ) -> tuple[Manifest, list[Future[Any]]]:
        m = plan(specs(ws), weight_version=version, bucket_bytes=BUCKET, checksum=checksum)
        m = Manifest.from_json(m.to_json())  # what receivers get: JSON, never objects
        futs = [spawn(r.deliver, m, tg) for r, tg in zip(self.receivers, targets, strict=True)]
        self.sender.send(m, iter(ws.items()), abort or Abort())
        return m, futs

    def close(self) -> None:
        for r in self.receivers:
            r.close()
        self.sender.close()


@pytest.fixture
def group2() -> Iterator[Group]:
    g = Group(2)
    yield g
    g.close()


@pytest.mark.parametrize("checksum", ["crc32", "sum64", None])
def test_round_trip_is_bit_exact_three_pushes_two_receivers(checksum: str | None) -> None:
    g = Group(2)
    try:
        for version in range(3):
            ws = weights(seed=version)
            targets = [DictTarget(), DictTarget()]
            m, futs = g.push(ws, version, targets, checksum=checksum)
            assert len(m.buckets) > 4  # tensors were split across buckets
            for f in futs:
                assert f.result(timeout=10)["bytes"] == m.total_bytes
            for tg in targets:
                assert sorted(tg.got) == sorted(ws)
                for name, t in ws.items():
                    assert same_bits(tg.got[name], t), name
        assert g.sender.gen == 1  # buffers shared once, reused by every push
    finally:
        g.close()


def test_buffers_are_unlinked_once_mapped_and_nothing_is_left_after_close() -> None:
    before = set(os.listdir(SHM))
    g = Group(1)
    ws = weights(0)
    m = plan(specs(ws), weight_version=1, bucket_bytes=BUCKET)
    fut = spawn(g.receivers[0].deliver, m, DictTarget())
    # While the first update is on its way the two files exist...
    g.sender._ensure_buffers(BUCKET + TRAILER_BYTES)
    assert len(g.files()) == 2
    g.sender.send(m, iter(ws.items()), Abort())
    fut.result(timeout=10)
    # ...and once every receiver mapped them, they are gone from /dev/shm.
    assert g.files() == []
    g.close()
    assert set(os.listdir(SHM)) - before == set()


class CorruptingSender(ShmSender):
    """Flips one payload byte of bucket 1 after it was sealed (its digest computed),
    which is what a torn or overwritten buffer looks like to a receiver. Test-only:
    it uses the `_sealed` seam that runs between sealing and publishing a bucket."""

    def _sealed(self, index: int, buf: torch.Tensor) -> None:
        if index == 1:
            buf[5] ^= 0xFF


@pytest.mark.parametrize("checksum", ["crc32", "sum64"])
def test_a_corrupted_bucket_is_refused_and_the_sender_hears_why(checksum: str) -> None:
    g = Group(1, sender_cls=CorruptingSender)
    try:
        ws = weights(1)
        m = plan(specs(ws), weight_version=1, bucket_bytes=BUCKET, checksum=checksum)
        target = DictTarget()
        fut = spawn(g.receivers[0].deliver, m, target)
        with pytest.raises(TransportError, match=r"rank 1 failed on bucket 1.*ChecksumError"):
            g.sender.send(m, iter(ws.items()), Abort())
        with pytest.raises(ChecksumError, match="bucket 1"):
            fut.result(timeout=10)
        assert g.receivers[0].broken  # the engine side drops it
        assert g.sender.broken  # and the coordinator rebuilds the group
    finally:
        g.close()


def test_a_receiver_that_never_acks_fails_the_sender_within_the_timeout() -> None:
    g = Group(1, timeout_s=1.0)
    try:
        ws = weights(3)
        m = plan(specs(ws), weight_version=3, bucket_bytes=BUCKET)
        t0 = time.monotonic()
        with pytest.raises(TransportError, match=r"receivers \[1\] did not acknowledge bucket 0"):
            g.sender.send(m, iter(ws.items()), Abort())  # nobody calls deliver()
        assert time.monotonic() - t0 < 4
        assert g.sender.broken
    finally:
        g.close()
    assert g.files() == []


def test_the_coordinators_abort_ends_a_send_blocked_on_acks_at_once() -> None:
    g = Group(1, timeout_s=20.0)
    hold = threading.Event()  # the target never gets past its first tensor
    try:
        ws = weights(4)
        m = plan(specs(ws), weight_version=4, bucket_bytes=BUCKET)
        fut = spawn(g.receivers[0].deliver, m, DictTarget(hold=hold))
        abort = Abort()
        threading.Timer(0.5, abort.fail, (RuntimeError("replica r0 died"),)).start()
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="replica r0 died"):
            g.sender.send(m, iter(ws.items()), abort)
        assert time.monotonic() - t0 < 5  # not the 20 s timeout
        hold.set()
        with pytest.raises(SenderAborted):
            fut.result(timeout=10)
    finally:
        hold.set()
        g.close()


def test_a_broken_stream_tells_every_receiver(group2: Group) -> None:
    ws = weights(5)
    m = plan(specs(ws), weight_version=5, bucket_bytes=BUCKET)
    futs = [spawn(r.deliver, m, DictTarget()) for r in group2.receivers]

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        items = list(ws.items())
        yield from items[:2]
        raise RuntimeError("trainer OOM while gathering")

    with pytest.raises(RuntimeError, match="trainer OOM"):
        group2.sender.send(m, stream(), Abort())
    for f in futs:
        with pytest.raises(SenderAborted, match="trainer OOM"):
            f.result(timeout=10)


def test_a_larger_update_gets_new_buffers_and_frees_the_old() -> None:
    g = Group(1)
    try:
        small = {"a": torch.arange(10, dtype=torch.float32)}
        big = weights(6)
        for i, ws in enumerate([small, big, big]):
            tg = DictTarget()
            m = plan(specs(ws), weight_version=i, bucket_bytes=BUCKET if i else 64)
            fut = spawn(g.receivers[0].deliver, m, tg)
            g.sender.send(m, iter(ws.items()), Abort())
            fut.result(timeout=10)
            assert all(same_bits(tg.got[n], t) for n, t in ws.items())
        assert g.sender.gen == 2
        assert g.files() == []
    finally:
        g.close()


RECEIVER_SCRIPT = r"""
import json, sys, zlib, torch
from enginehooks.core.manifest import Manifest
from enginehooks.transports.shm import ShmTransport
ep, manifest = json.loads(sys.argv[1]), Manifest.from_json(sys.argv[2])
r = ShmTransport().receiver(ep, 1, torch.device("cpu"))
r.connect()
from enginehooks.transports.base import Target
class T(Target):
    device = torch.device("cpu")
    def apply(self, it):
        b = lambda t: t.contiguous().reshape(-1).view(torch.uint8).numpy()
        self.crc = {n: zlib.crc32(b(t)) for n, t in it}
t = T()
r.deliver(manifest, t)
r.close()
print(json.dumps(t.crc))
"""


def test_receiver_in_another_process() -> None:
    # The receiver is a fresh interpreter importing torch: generous on a loaded host.
    sender = ShmSender(host="127.0.0.1", port=0, timeout_s=90.0)
    try:
        ws = weights(7)
        m = plan(specs(ws), weight_version=7, bucket_bytes=BUCKET)
        ep = dict(sender.endpoint(), world_size=2)
        proc = subprocess.Popen(
            [sys.executable, "-c", RECEIVER_SCRIPT, json.dumps(ep), m.to_json()],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        sender.connect(2)
        sender.send(m, iter(ws.items()), Abort())
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        import zlib

        got = json.loads(out.strip().splitlines()[-1])
        for name, t in ws.items():
            assert got[name] == zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    finally:
        sender.close()


# -- WeightSync through an in-process engine side ------------------------------------------


def test_weightsync_pushes_over_shm_into_two_replicas() -> None:
    def net(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.LayerNorm(80),
                                   torch.nn.Linear(80, 8))

    trainer = net(0)
    engines = [LocalEngine(net(1), name="r0"), LocalEngine(net(2), name="r1")]
    before = set(os.listdir(SHM))
    with WeightSync("shm", bucket_bytes=8192, timeout_s=10, checksum="sum64") as sync:
        for e in engines:
            sync.add_replica(e)
        for version in (1, 2, 3):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(0.01 * version)
            report = sync.push(trainer, version=version)
            assert report.ok, report.error
            for e in engines:
                assert e.side.version == version
                for (n, a), b in zip(trainer.state_dict().items(),
                                     e.target.module.state_dict().values(), strict=True):
                    assert same_bits(a, b), n
    assert set(os.listdir(SHM)) - before == set()


def test_an_unreachable_store_fails_the_join_within_the_connect_timeout() -> None:
    """Joining has its own bound (`connect_timeout_s`, at least 30 s by default so a slow
    DNS answer inside torch's TCPStore cannot fail a group); the endpoint carries it."""
    sender = ShmSender(host="127.0.0.1", port=0, timeout_s=2.0)
    ep = dict(sender.endpoint(), world_size=2)
    assert ep["connect_timeout_s"] == 30.0  # the floor over a 2 s timeout
    sender.close()
    del sender
    gc.collect()  # the store is gone: nothing listens on that port any more
    ep["connect_timeout_s"] = 1.0
    receiver = ShmTransport().receiver(ep, 1, torch.device("cpu"))
    t0 = time.monotonic()
    with pytest.raises(TransportError, match=r"cannot reach the rendezvous store .* within 1.0s"):
        receiver.connect()
    assert time.monotonic() - t0 < 10


# -- segments of a sender killed with its resource tracker ---------------------------------

KILLED_SENDER = r"""
import sys, time
from enginehooks.transports.shm import ShmSender
s = ShmSender(host="127.0.0.1", port=0, timeout_s=30)
s._ensure_buffers(4096)
print(s.group_id, flush=True)
time.sleep(600)
"""


def test_segments_of_a_killed_process_group_are_reclaimed_by_the_next_sender() -> None:
    """SIGKILL to the trainer's whole process group takes `multiprocessing`'s resource
    tracker with it, so nothing unlinks the segments: the next sender on the host does
    (issue 19). A live sender's segments are left alone."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SENDER], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    live = ShmSender(host="127.0.0.1", port=0, timeout_s=5)
    try:
        assert proc.stdout is not None
        group = proc.stdout.readline().strip()
        assert group, "the sender subprocess did not start"
        live._ensure_buffers(4096)
        theirs = sorted(SHM.glob(f"enginehooks-{group}-*"))
        mine = sorted(SHM.glob(f"enginehooks-{live.group_id}-*"))
        assert len(theirs) == 2 and len(mine) == 2
        assert all(p.name.endswith(f"-{proc.pid}") for p in theirs)
        ShmSender(host="127.0.0.1", port=0, timeout_s=5).close()  # the owner is alive: kept
        assert sorted(SHM.glob(f"enginehooks-{group}-*")) == theirs
        os.killpg(proc.pid, 9)  # the sender and its resource tracker
        proc.wait(timeout=30)
        time.sleep(0.2)
        assert sorted(SHM.glob(f"enginehooks-{group}-*")) == theirs  # leaked
        ShmSender(host="127.0.0.1", port=0, timeout_s=5).close()
        assert list(SHM.glob(f"enginehooks-{group}-*")) == []  # reclaimed
        assert sorted(SHM.glob(f"enginehooks-{live.group_id}-*")) == mine  # a live one kept
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=30)
        live.close()
        for p in SHM.glob("enginehooks-*"):
            if p.name.endswith(f"-{proc.pid}"):
                p.unlink()


def test_segments_of_other_pid_namespaces_users_and_names_are_never_reclaimed(
        tmp_path: Path) -> None:
    """A PID means nothing outside its namespace (containers sharing /dev/shm), so only
    files of this namespace are judged; names not of this form are not ours."""
    from enginehooks.transports.shm import pid_namespace, reclaim_orphans

    ns = pid_namespace()
    assert ns is not None
    dead = 2**22 + 12345  # above the default pid_max: no process has it
    names = {
        f"enginehooks-0123456789ab-1-0-{ns}-{dead}": True,  # this namespace, dead owner
        f"enginehooks-0123456789ab-1-1-{ns + 1}-{dead}": False,  # another namespace
        f"enginehooks-0123456789ab-1-0-{ns}-{os.getpid()}": False,  # alive (us)
        f"enginehooks-0123456789ab-1-0-{ns}-{dead}.bak": False,  # not our name
        "enginehooks-0123456789ab-1-0": False,  # an old-style name: no owner to judge
    }
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    if os.getuid() == 0:  # only root can make a file another user's
        other_user = f"enginehooks-0123456789ab-2-0-{ns}-{dead}"
        (tmp_path / other_user).write_bytes(b"x")
        os.chown(tmp_path / other_user, 65534, 65534)
        names[other_user] = False  # another user's: not ours to remove
    removed = {p.name for p in reclaim_orphans(tmp_path)}
    assert removed == {n for n, gone in names.items() if gone}
    assert {p.name for p in tmp_path.iterdir()} == {n for n, gone in names.items() if not gone}
