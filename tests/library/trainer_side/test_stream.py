"""The trainer stream does no per-tensor host work (issue 37 item 2), on CPU.

Real FSDP2 (`fully_shard`, DTensors) over gloo in 2 trainer processes, and on a mesh of
one rank, pushes a tiny Llama into an in-process module replica (`LocalEngine`):

- one `model.state_dict()` per push at most (the plan and every group share it), where
  there was one per conversion group, and none once the model's state map holds;
- lockstep flags per stretch of the stream (one per push for a model this small), never
  per tensor, on the sender and on the follower alike;
- on a mesh of one rank no `full_tensor()` at all (the local tensor is the whole one);
- the pushed bytes are unchanged: the replica equals the gathered state dict bit for bit
  (the oracle of `tests/vllm/test_trainer_sharded.py`'s FSDP1 test);
- a push that stops mid-stream still releases the follower with the sender's reason
  (the sender finishes the collectives up to the next flag, then says STOP there);
- each rank produces only what it sends (item 5): with one sender the follower gathers
  to the sender and converts nothing; with both ranks sending, each casts its share.

Each scenario runs this file as a script in WORLD processes (`python
tests/library/trainer_side/test_stream.py SCENARIO RANK WORLD PORT OUT`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support import ranks as support_ranks

BUCKET = 32 << 10


def run_ranks(scenario: str, out: Path, extra: dict[str, Any], world: int,
              timeout_s: float = 240.0) -> list[dict[str, Any]]:
    """This file's ranks (`tests/support/ranks.py`)."""
    return support_ranks.run_ranks(__file__, scenario, out, extra, world, timeout_s)


# -- the ranks ----------------------------------------------------------------------------
class Counted:
    """Counts calls of `obj.attr` (an instance attribute shadows the method)."""

    def __init__(self, obj: Any, attr: str) -> None:
        self.calls = 0
        inner = getattr(obj, attr)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return inner(*args, **kwargs)

        setattr(obj, attr, counted)


def _sharded(path: Path, seed: int) -> Any:
    from torch.distributed.fsdp import fully_shard

    from enginehooks_testkit.tiny import load_tiny, perturb

    model = perturb(load_tiny(path), seed=seed)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _replica(path: Path) -> Any:
    import torch

    from enginehooks_testkit.tiny import load_tiny

    m = load_tiny(path)
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    return m


def _full(model: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))


def _bit_exact(target: Any, want: dict[str, Any]) -> bool:
    import torch

    got = target.state_dict()
    return sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


class ClassCounted:
    """Counts calls of a class's method in this process."""

    def __init__(self, cls: Any, attr: str) -> None:
        self.calls = 0
        inner = getattr(cls, attr)

        def counted(obj: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return inner(obj, *args, **kwargs)

        setattr(cls, attr, counted)


def scenario_two(rank: int, extra: dict[str, Any], out: Path) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor

    from enginehooks import WeightSync
    from enginehooks.engine.local import LocalEngine
    from enginehooks.trainer_side import FSDP2Adapter, PushAborted, follow, push

    path = Path(extra["model"])
    model = _sharded(path, seed=91)
    calls = Counted(model, "state_dict")
    gathers = ClassCounted(DTensor, "full_tensor")
    casts = ClassCounted(FSDP2Adapter, "to_wire")
    res: dict[str, Any] = {"state_dict_calls": [], "flags": [], "bit_exact": [],
                           "full_tensor_calls": [], "to_wire_calls": []}
    sync = target = None
    if rank == 0:
        target = _replica(path)
        sync = WeightSync("gloo", bucket_bytes=BUCKET, timeout_s=60)
        sync.add_replica(LocalEngine(target, name="fsdp2-replica"))
    for version in (1, 2):
        adapter = FSDP2Adapter(model, start_timeout_s=60.0)
        before, gathered, cast = calls.calls, gathers.calls, casts.calls
        push(adapter, version, sync=sync)
        res["state_dict_calls"].append(calls.calls - before)
        res["flags"].append(adapter.flags)
        res["full_tensor_calls"].append(gathers.calls - gathered)
        res["to_wire_calls"].append(casts.calls - cast)
        res["tensors"] = adapter.planned
        want = _full(model)  # a collective: every rank
        if rank == 0:
            res["bit_exact"].append(_bit_exact(target, want))
        with torch.no_grad():  # "train": every rank changes its shards
            for p in model.parameters():
                p.to_local().mul_(1.25)

    # a push that stops mid-stream: flags every few elements, the sender gives up after
    # three tensors; the follower must be released with the reason, not left in a gather
    small = FSDP2Adapter(model, start_timeout_s=60.0, flag_elements=4096)
    if rank == 0:
        small.specs()
        it = small.stream()
        for _ in range(3):
            next(it)
        small.cancel("stopped on purpose")
        res["mid_flags"] = small.flags
    else:
        try:
            follow(small)
            res["mid"] = "followed to the end?!"
        except PushAborted as e:
            res["mid"] = e.reason
    if rank == 0:
        assert sync is not None
        sync.close()
    return res


def scenario_multi(rank: int, extra: dict[str, Any], out: Path) -> dict[str, Any]:
    """Both ranks send (`WeightSync(senders=...)`): each gathers, converts and casts
    only its own share."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from enginehooks import WeightSync
    from enginehooks.engine.local import LocalEngine
    from enginehooks.trainer_side import FSDP2Adapter, TrainerRanks

    path = Path(extra["model"])
    model = _sharded(path, seed=95)
    control = dist.new_group(backend="gloo")  # FSDP2 gathers on the default group
    sync = WeightSync("gloo", senders=TrainerRanks(control, timeout_s=60), host="127.0.0.1",
                      timeout_s=60, bucket_bytes=BUCKET)
    target = None
    if rank == 0:
        target = _replica(path)
        sync.add_replica(LocalEngine(target, name="multi-replica"))
    gathers = ClassCounted(DTensor, "full_tensor")
    casts = ClassCounted(FSDP2Adapter, "to_wire")
    report = sync.push(model, 1)
    res: dict[str, Any] = {"full_tensor_calls": gathers.calls, "to_wire_calls": casts.calls,
                           "part_tensors": report.tensors if rank else None}
    want = _full(model)
    if rank == 0:
        assert target is not None
        res["bit_exact"] = _bit_exact(target, want)
        res["tensors"] = report.tensors
    sync.close()
    dist.barrier()  # rank 0 stays until rank 1's close has its last answer
    return res


def scenario_one(rank: int, extra: dict[str, Any], out: Path) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from enginehooks import WeightSync
    from enginehooks.engine.local import LocalEngine
    from enginehooks.trainer_side import FSDP2Adapter, push

    path = Path(extra["model"])
    model = _sharded(path, seed=93)
    gathers = {"n": 0}
    full_tensor = DTensor.full_tensor

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        gathers["n"] += 1
        return full_tensor(self, *args, **kwargs)

    DTensor.full_tensor = counted  # type: ignore[method-assign]
    calls = Counted(model, "state_dict")
    target = _replica(path)
    sync = WeightSync("gloo", bucket_bytes=BUCKET, timeout_s=60)
    sync.add_replica(LocalEngine(target, name="fsdp2-one"))
    adapter = FSDP2Adapter(model)
    push(adapter, 1, sync=sync)
    res = {"state_dict_calls": calls.calls, "full_tensor_calls": gathers["n"],
           "flags": adapter.flags}
    DTensor.full_tensor = full_tensor  # type: ignore[method-assign]
    res["bit_exact"] = _bit_exact(target, _full(model))
    sync.close()
    return res


if __name__ == "__main__":
    support_ranks.rank_main(globals())


# -- the tests --------------------------------------------------------------------------------
def test_two_fsdp2_ranks_read_the_state_dict_once_and_flag_once_per_push(
        tiny_llama: Path, tmp_path: Path) -> None:
    r0, r1 = run_ranks("two", tmp_path, {"model": str(tiny_llama)}, world=2)
    assert r0["bit_exact"] == [True, True]  # the bytes are unchanged, push after push
    for r in (r0, r1):
        # one walk for the first push (plan and stream share it), none for the second:
        # training in place left the registered tensors as the map holds them
        # (`test_state_refs.py` has the cases that walk again)
        assert r["state_dict_calls"] == [1, 0]
        assert r["flags"] == [1, 1]  # one GO per push for a model this small, never per tensor
    assert r0["mid_flags"] >= 1
    assert r1["mid"] == "stopped on purpose"
    # each rank produces only what it sends (issue 37 item 5): the sender gathers every
    # tensor to itself alone (no all-gather), the follower contributes its shards and
    # converts or casts nothing
    n = r0["tensors"]
    assert r0["full_tensor_calls"] == r1["full_tensor_calls"] == [0, 0]
    assert r0["to_wire_calls"] == [n, n] and r1["to_wire_calls"] == [0, 0]


def test_several_fsdp2_senders_each_produce_only_their_share(
        tiny_llama: Path, tmp_path: Path) -> None:
    r0, r1 = run_ranks("multi", tmp_path, {"model": str(tiny_llama)}, world=2)
    assert r0["bit_exact"] is True
    assert r0["full_tensor_calls"] == r1["full_tensor_calls"] == 0
    # every tensor is cast once, by the rank that sends it; both ranks send a share
    assert r0["to_wire_calls"] + r1["to_wire_calls"] == r0["tensors"]
    assert 0 < r1["to_wire_calls"] < r0["tensors"]


def test_a_mesh_of_one_rank_gathers_nothing(tiny_llama: Path, tmp_path: Path) -> None:
    (r,) = run_ranks("one", tmp_path, {"model": str(tiny_llama)}, world=1)
    assert r["bit_exact"] is True
    assert r["full_tensor_calls"] == 0  # to_local(): the local tensor is the whole one
    assert r["state_dict_calls"] == 1
    assert r["flags"] == 0  # alone: no flag at all
