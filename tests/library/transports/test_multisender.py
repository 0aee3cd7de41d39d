"""Several senders (issue 23), the pure parts: who sends which tensor, the one manifest
and each sender's part of it, the send order. The end-to-end push from several trainer
processes is in tests/multihost/test_multi_sender.py; the static schedule's tests are in
tests/library/project/test_static_schedule.py."""

from __future__ import annotations

import json

import pytest
import torch

from enginehooks.core.auth import AuthError
from enginehooks.core.buckets import Unpacker, manifest_id, pack
from enginehooks.core.errors import ManifestError, TransportError
from enginehooks.core.manifest import Manifest, TensorSpec, plan
from enginehooks.core.senders import (
    assign_balanced,
    decide_parts,
    only,
    order_of,
    parts,
    send_order,
    sender_ranges,
)

SECRET = b"s" * 32


def specs(*sizes: int, dtype: str = "float32") -> list[TensorSpec]:
    return [TensorSpec(f"t{i}", dtype, (n,)) for i, n in enumerate(sizes)]


def test_balanced_assignment_interleaves_and_balances_bytes() -> None:
    s = specs(100, 100, 100, 100, 10, 10, 10, 10)
    owners = assign_balanced(s, 2)
    assert owners == [0, 1, 0, 1, 0, 1, 0, 1]
    # one big tensor: the others go to the rest until they catch up
    owners = assign_balanced(specs(400, 100, 100, 100, 100), 2)
    assert owners == [0, 1, 1, 1, 1]
    # a big tensor last (an untied head) is placed first, not left to unbalance the end
    owners = assign_balanced(specs(100, 100, 100, 100, 400), 2)
    assert owners == [1, 1, 1, 1, 0]
    loads = [0, 0, 0]
    big = specs(*range(1, 200))
    for spec, j in zip(big, assign_balanced(big, 3)):
        loads[j] += spec.nbytes
    assert max(loads) - min(loads) <= 199 * 4  # within the largest tensor
    with pytest.raises(ValueError):
        assign_balanced(s, 0)


def test_decide_parts_shares_the_whole_model_and_keeps_owned_parts() -> None:
    s = specs(10, 20, 30, 40)
    shared = decide_parts([s, s])
    assert sorted(x.name for p in shared for x in p) == sorted(x.name for x in s)
    assert all(shared)
    owned = decide_parts([s[:1], s[1:]])
    assert owned == [s[:1], s[1:]]
    with pytest.raises(ManifestError, match="trainer ranks 0 and 1 both stream 't1'"):
        decide_parts([s[:2], s[1:]])


def manifest_of(per: list[list[TensorSpec]], bucket_bytes: int = 256) -> Manifest:
    return plan(parts=per, weight_version=7, bucket_bytes=bucket_bytes, checksum="crc32",
                meta={"transport": "gloo"})


def test_one_manifest_lists_each_senders_buckets_and_parts_are_standalone() -> None:
    per = [specs(10, 100, 3), [TensorSpec("u0", "bfloat16", (300,)), TensorSpec("u1", "int64", (0,))]]
    m = manifest_of(per)
    assert [t.name for t in m.tensors] == ["t0", "t1", "t2", "u0", "u1"]
    ranges = sender_ranges(m)
    assert ranges[0][0] == 0 and ranges[1][0] == ranges[0][1]
    assert ranges[1][0] + ranges[1][1] == len(m.buckets)
    # round trip through JSON (the manifest crosses the network, signed)
    m2 = Manifest.from_json(m.to_json())
    ps = parts(m2)
    assert [[t.name for t in p.tensors] for p in ps] == [["t0", "t1", "t2"], ["u0", "u1"]]
    # a part is what that sender alone would have planned, plus who it is
    alone = plan(per[1], weight_version=7, bucket_bytes=256, checksum="crc32",
                 meta={"transport": "gloo"})
    assert ps[1].tensors == alone.tensors and ps[1].buckets == alone.buckets
    assert ps[1].meta["part"] == 1 and ps[1].meta["parts"] == 2
    assert ps[1].meta["update"] == f"{manifest_id(m):016x}"
    # every part has an id of its own: a bucket of one cannot pass as another's
    assert len({manifest_id(p) for p in ps} | {manifest_id(m)}) == 3
    # one sender, no key: the manifest is its own part
    single = plan(per[0], weight_version=7, bucket_bytes=256, checksum="crc32")
    assert parts(single) == [single]


def test_a_name_planned_by_two_senders_is_refused() -> None:
    with pytest.raises(ManifestError, match="appears twice"):
        manifest_of([specs(10), specs(10)])


@pytest.mark.parametrize("bad, match", [
    ([[0, 1, 0, 2]], "covers"),
    ([[0, 1, 0, 1], [2, 1, 1, 2]], "contiguous"),
    ([[0, "1", 0, 1]], "4 integers"),
    ("x", "non-empty list"),
])
def test_sender_runs_that_do_not_cover_the_manifest_are_refused(bad: object, match: str) -> None:
    m = manifest_of([specs(10), specs(10, 10)[1:]])
    d = m.to_dict()
    d["meta"]["senders"] = bad
    with pytest.raises(ManifestError, match=match):
        parts(Manifest.from_dict(d))


def test_a_tensor_outside_its_senders_buckets_is_refused() -> None:
    m = manifest_of([specs(10, 10), [TensorSpec("u", "float32", (10,))]])
    d = m.to_dict()
    d["meta"]["senders"] = [[0, 1, 0, 1], [1, 1, 1, 2]]  # t1 (bucket 0) given to sender 1
    with pytest.raises(ManifestError, match="outside that sender's buckets"):
        parts(Manifest.from_dict(d))


def roundtrip(part: Manifest, tensors: dict[str, torch.Tensor], secret: bytes | None,
              receiver_part: Manifest | None = None,
              receiver_secret: bytes | None = None) -> dict[str, torch.Tensor]:
    from enginehooks.core.buckets import buffer_bytes

    size = buffer_bytes(part)
    bufs = []
    for _i, buf in pack(part, [(t.name, tensors[t.name]) for t in part.tensors],
                        lambda _i: torch.empty(size, dtype=torch.uint8), secret):
        bufs.append(buf.clone())
    rp = receiver_part or part
    un = Unpacker(rp, "cpu", None, receiver_secret if receiver_secret is not None else secret)
    out: dict[str, torch.Tensor] = {}
    for i, b in enumerate(bufs):
        out.update({n: t.clone() for n, t in un.unpack(i, b)})
    return out


def test_each_part_packs_and_unpacks_with_the_single_sender_code_and_is_checked() -> None:
    per = [specs(10, 100), [*specs(5, 70, 33)[1:], TensorSpec("w", "float32", (7,))]]
    per[1] = [TensorSpec(f"s{i}", x.dtype, x.shape) for i, x in enumerate(per[1])]
    m = manifest_of(per, bucket_bytes=128)
    g = torch.Generator().manual_seed(0)
    tensors = {t.name: torch.randn(t.shape, generator=g) for t in m.tensors}
    ps = parts(m)
    got = {}
    for p in ps:
        got.update(roundtrip(p, tensors, SECRET))
    assert set(got) == set(tensors) and all(torch.equal(got[n], tensors[n]) for n in tensors)
    # a bucket of part 1 offered as part 0's: another update id
    with pytest.raises(TransportError, match="another update"):
        roundtrip(ps[1], tensors, SECRET, receiver_part=ps[0])
    # signed with another secret: refused
    with pytest.raises(AuthError):
        roundtrip(ps[0], tensors, b"x" * 32, receiver_secret=SECRET)


def test_the_senders_list_is_covered_by_the_manifest_id() -> None:
    m = manifest_of([specs(10, 10), [TensorSpec("u", "float32", (10,))]])
    d = json.loads(m.to_json())
    assert manifest_id(Manifest.from_dict(d)) == manifest_id(m)
    d["meta"]["senders"] = [[0, 2, 0, 3]]  # one sender claims everything
    assert manifest_id(Manifest.from_dict(d)) != manifest_id(m)


def test_several_senders_run_over_gloo_and_nccl_and_a_receiver_needs_its_senders() -> None:
    from enginehooks.control.multisend import MultiSenderSync
    from enginehooks.core.errors import ConfigError
    from enginehooks.plugins import get_transport
    from enginehooks.transports.broadcast import BroadcastReceiver
    from enginehooks.transports.multisender import MultiReceiver

    # the collective transports are built; the others (one copy per replica, or files)
    # have no groups to split an update over
    for transport in ("cuda_ipc", "disk", "shm"):
        with pytest.raises(ConfigError, match="several senders run over"):
            MultiSenderSync(None, transport)  # type: ignore[arg-type]
    sync = MultiSenderSync(None, "nccl")  # type: ignore[arg-type]
    assert sync.senders is None and sync.transport_name == "nccl"
    # the one coordinator refuses them the same way (MultiSenderSync is its alias)
    from enginehooks import WeightSync
    from enginehooks.trainer_side import TrainerRanks

    with pytest.raises(ConfigError, match="several senders run over"):
        WeightSync("disk", senders=TrainerRanks())
    assert WeightSync("gloo", senders=TrainerRanks()).senders is not None
    for bad in ("x", [], None):
        with pytest.raises(TransportError, match="lists its senders"):
            MultiReceiver({"senders": bad, "world_size": 2}, 1, torch.device("cpu"))
    # an nccl worker gets one receiver per sender's group, on its own device (CPU here:
    # no CUDA call is made before connect()); a single sender's endpoint, one receiver
    ep = {"transport": "nccl", "host": "127.0.0.1", "port": 1, "group": "g", "timeout_s": 5.0}
    multi = get_transport("nccl").receiver(
        {**ep, "world_size": 3, "senders": [ep, {**ep, "port": 2, "group": "h"}]}, 1,
        torch.device("cpu"))
    assert isinstance(multi, MultiReceiver) and len(multi.parts) == 2
    assert [p.port for p in multi.parts] == [1, 2] and not multi.cuda
    single = get_transport("nccl").receiver({**ep, "world_size": 3}, 1, torch.device("cpu"))
    assert type(single) is BroadcastReceiver


def test_an_nccl_sender_without_a_gpu_index_takes_the_current_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`BroadcastSender(device=None / "cuda")` over nccl must name a GPU: `connect()`
    sets it as the current device, which an index-less "cuda" cannot be. No GPU here:
    the monkeypatched `torch.cuda.current_device` STANDS IN FOR A GPU (this process's
    current device being cuda:1); nothing touches CUDA before `connect()`."""
    from enginehooks.transports.broadcast import BroadcastSender

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    for device in (None, "cuda", torch.device("cuda")):
        s = BroadcastSender("nccl", host="127.0.0.1", port=0, timeout_s=5.0, device=device)
        try:
            assert s.device == torch.device("cuda", 1)
        finally:
            s.close()
    s = BroadcastSender("nccl", host="127.0.0.1", port=0, timeout_s=5.0, device="cuda:3")
    assert s.device == torch.device("cuda", 3)
    s.close()
    s = BroadcastSender("gloo", host="127.0.0.1", port=0, timeout_s=5.0)
    assert s.device == torch.device("cpu")
    s.close()


def test_a_parts_error_names_its_sender_and_keeps_its_class() -> None:
    from enginehooks.core.errors import ChecksumError, SenderAborted
    from enginehooks.transports.multisender import named

    for e in (SenderAborted("the sender aborted the update: boom"),
              ChecksumError("bucket 3: crc32 mismatch")):
        out = named(e, "sender rank 1 (10.78.0.2:5000)")
        assert type(out) is type(e) and out.__cause__ is e
        assert str(out).startswith("sender rank 1 (10.78.0.2:5000): ") and str(e) in str(out)
    out = named(RuntimeError("Connection closed by peer"), "sender rank 2")
    assert isinstance(out, TransportError)
    assert str(out) == "sender rank 2: RuntimeError: Connection closed by peer"


# -- the send order (issue 23: NCCL lockstep deadlock) ----------------------------------------
def lockstep_specs(vocab: int = 64, layers: int = 3) -> list[TensorSpec]:
    """An embedding first and a head last, each larger than the small buckets, layers
    between (the shape of the 4-GPU test that hung)."""
    out = [TensorSpec("embed", "float32", (vocab, 8))]
    for i in range(layers):
        out += [TensorSpec(f"l{i}.a", "float32", (8,)), TensorSpec(f"l{i}.b", "float32", (8, 8)),
                TensorSpec(f"l{i}.c", "float32", (24, 8)), TensorSpec(f"l{i}.d", "float32", (3,))]
    return [*out, TensorSpec("head", "float32", (vocab, 8))]


def lockstep_manifest(s: list[TensorSpec], senders: int, bucket: int,
                      direct_min: int | None = None) -> Manifest:
    return plan(parts=decide_parts([s] * senders), weight_version=1, bucket_bytes=bucket,
                checksum="sum64", meta={}, direct_min=direct_min)


def trainer_programs(m: Manifest, s: list[TensorSpec]) -> list[list[tuple[str, object]]]:
    """What each lockstep trainer rank does, in order, replayed through the real `pack`
    with `BroadcastSender.send`'s buffer rule: ("step", i) enter the lockstep collective
    of stream position i; ("end", n) the stream ended; ("wait", (j, k)) drain bucket k
    of its own part; ("send", (j, k)) post the broadcast of its bucket k; then it drains
    the last two."""
    progs: list[list[tuple[str, object]]] = []
    for j, part in enumerate(parts(m)):
        prog: list[tuple[str, object]] = []

        def stream(prog: list[tuple[str, object]] = prog):
            for i, spec in enumerate(s):
                prog.append(("step", i))
                yield spec.name, torch.zeros(spec.shape, dtype=torch.float32)
            prog.append(("end", len(s)))  # the stream ended (no collective)

        def next_buffer(k: int, prog: list[tuple[str, object]] = prog, j: int = j) -> torch.Tensor:
            if k >= 2:
                prog.append(("wait", (j, k - 2)))
            return torch.zeros(1 << 16, dtype=torch.uint8)

        names = {t.name for t in part.tensors}
        for k, _buf in pack(part, only(stream(), names), next_buffer):
            prog.append(("send", (j, k)))
        n = len(part.buckets)
        prog += [("wait", (j, k)) for k in range(max(0, n - 2), n)]
        progs.append(prog)
    return progs


def simulate(m: Manifest, s: list[TensorSpec], ordered: bool, in_launch_order: bool) -> bool:
    """Lockstep trainer ranks and one engine worker; True if every bucket arrives.

    A collective completes once every member posted it and, with `in_launch_order` (the
    NCCL hazard: CUDA need not run a kernel while an earlier one of another stream waits
    for its peers), once every collective its members posted before it completed. The
    worker posts receives in the send order (`ordered`, one thread) or each part on its
    own thread (its next bucket posted as soon as the last arrived)."""
    senders = len(parts(m))
    order = send_order(m, [x.name for x in s])
    assert order is not None
    m = Manifest.from_dict({**m.to_dict(), "meta": {**m.meta, "order": order}})
    pairs = order_of(m)
    assert pairs is not None
    counts = [len(p.buckets) for p in parts(m)]
    # threads: (process, program); a program is a list of ("post", c) / ("wait", c)
    threads: list[tuple[str, list[tuple[str, object]]]] = []
    for j, prog in enumerate(trainer_programs(m, s)):
        out: list[tuple[str, object]] = []
        for op, arg in prog:
            if op == "step":
                out += [("post", ("step", arg)), ("wait", ("step", arg))]
            elif op == "send":
                out.append(("post", ("b", arg)))
            elif op == "wait":
                out.append(("wait", ("b", arg)))
        threads.append((f"t{j}", out))
    if ordered:
        seq = [("b", p) for p in pairs]
        prog = [("post", seq[0])] if seq else []
        for g, c in enumerate(seq):
            prog.append(("wait", c))
            if g + 1 < len(seq):
                prog.append(("post", seq[g + 1]))
        threads.append(("w", prog))
    else:
        for j in range(senders):
            seq = [("b", (j, k)) for k in range(counts[j])]
            prog = [("post", seq[0])] if seq else []
            for g, c in enumerate(seq):
                prog += [("wait", c)] + ([("post", seq[g + 1])] if g + 1 < len(seq) else [])
            threads.append(("w", prog))

    def members(c: tuple) -> set[str]:
        return {f"t{j}" for j in range(senders)} if c[0] == "step" else {f"t{c[1][0]}", "w"}

    posted: dict[str, list[tuple]] = {}
    done: set[tuple] = set()
    pc = [0] * len(threads)
    while True:
        moved = False
        for c in {c for cs in posted.values() for c in cs} - done:
            if all(c in posted.get(p, []) for p in members(c)) and (not in_launch_order or all(
                    set(posted[p][:posted[p].index(c)]) <= done for p in members(c))):
                done.add(c)
                moved = True
        for t, (proc, prog) in enumerate(threads):
            while pc[t] < len(prog):
                op, c = prog[pc[t]]
                if op == "post":
                    posted.setdefault(proc, []).append(c)
                elif c not in done:
                    break
                pc[t] += 1
                moved = True
        if not moved:
            return all(pc[t] == len(p) for t, (_proc, p) in enumerate(threads))


def test_the_send_order_is_when_pack_seals_each_bucket() -> None:
    s = lockstep_specs()
    for bucket, direct_min in ((64, None), (256, None), (1000, None), (4096, None),
                               (1 << 20, None), (256, 512), (1000, 256)):
        m = lockstep_manifest(s, 2, bucket, direct_min)
        order = send_order(m, [x.name for x in s])
        sent = []
        firsts = [r[0] for r in sender_ranges(m)]
        for j, prog in enumerate(trainer_programs(m, s)):
            at = 0
            for op, arg in prog:
                if op in ("step", "end"):
                    at = arg
                elif op == "send":
                    sent.append((at, j, firsts[j] + arg[1]))
        assert [g for *_x, g in sorted(sent)] == order, bucket
        assert sorted(order) == list(range(len(m.buckets)))


def test_concurrent_parts_deadlock_under_nccl_launch_order_and_the_send_order_does_not() -> None:
    """The 4-GPU hang, reproduced as a model: with buckets smaller than the embedding,
    receiving the parts concurrently completes when collectives progress independently
    (gloo) but not when a GPU may run them only in launch order (NCCL); the send order
    completes either way, for any bucket size and sender count."""
    s = lockstep_specs()
    m = lockstep_manifest(s, 2, 256)
    assert simulate(m, s, ordered=False, in_launch_order=False)  # gloo: passes
    assert not simulate(m, s, ordered=False, in_launch_order=True)  # the H200 hang
    assert simulate(m, s, ordered=True, in_launch_order=True)
    # one bucket per sender: no rank drains before the lockstep ends (the case that passed)
    big = lockstep_manifest(s, 2, 1 << 20)
    assert simulate(big, s, ordered=False, in_launch_order=True)
    import random

    rng = random.Random(5)
    for _ in range(60):
        sizes = [rng.choice([1, 3, 8, 40, 100, 700]) for _ in range(rng.randint(1, 14))]
        sp = [TensorSpec(f"x{i}", "float32", (n,)) for i, n in enumerate(sizes)]
        mm = lockstep_manifest(sp, rng.randint(1, 3), rng.choice([64, 200, 1000, 5000]),
                               direct_min=rng.choice([None, 256]))
        assert simulate(mm, sp, ordered=True, in_launch_order=True), (sizes, mm.meta)


def test_a_send_order_is_checked() -> None:
    m = lockstep_manifest(lockstep_specs(), 2, 256)
    n = len(m.buckets)
    assert order_of(m) is None

    def with_order(order: object) -> Manifest:
        return Manifest.from_dict({**m.to_dict(), "meta": {**m.meta, "order": order}})

    first1 = sender_ranges(m)[1][0]
    ok = order_of(with_order([first1, *[g for g in range(n) if g != first1]]))
    assert ok is not None and ok[0] == (1, 0) and ok[1] == (0, 0)
    for bad in ([0] * n, list(range(n - 1)), "x", [1, 0, *range(2, n)], [True, *range(1, n)]):
        with pytest.raises(ManifestError):
            order_of(with_order(bad))
