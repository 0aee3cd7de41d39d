"""The model's state map (`trainer_side/state_refs.py`): a push after the first reads the
FSDP2 model's tensors without walking it, and walks it whenever the walk could give
something else.

Real FSDP2 (`fully_shard`) on a mesh of one rank over gloo, in a process of its own (this
file run as a script), pushing a tiny Llama into an in-process module replica
(`LocalEngine`) over gloo; after every push the replica must equal the gathered state
dict bit for bit. Each case counts `model.state_dict()` calls per push:

- trained in place (the optimizer's way): no walk after the first push;
- a parameter replaced by a new object: a walk, and the new values land;
- a module left unsharded (FSDP2 registers other objects then): a walk, whose pre-save
  hook reshards it, and the bytes land;
- a state-dict hook that changes entries: never a map, a walk every push.

It also counts the adapter's `_produce` calls: a push whose map holds replays the last
push's stream (views of the model's memory: nothing produced, the trained bytes sent);
every case that walks produces anew.

The map's own checks on a plain module (no process): `param.data` swapped for another
dtype or shape keeps the object but fails the check; a dropped module or tensor is not
kept alive by the map.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support import ranks as support_ranks

BUCKET = 32 << 10


def _sharded(path: Path, seed: int) -> Any:
    from torch.distributed.fsdp import fully_shard

    from enginehooks_testkit.tiny import load_tiny, perturb

    model = perturb(load_tiny(path), seed=seed)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _bit_exact(target: Any, model: Any) -> bool:
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    want = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    got = target.state_dict()
    return sorted(got) == sorted(want) and all(
        torch.equal(got[k], want[k].to(got[k].dtype)) for k in want)


def scenario_cases(rank: int, extra: dict[str, Any], out: Path) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor

    from enginehooks import WeightSync
    from enginehooks.engine.local import LocalEngine
    from enginehooks.trainer_side import FSDP2Adapter
    from enginehooks_testkit.tiny import load_tiny

    path = Path(extra["model"])
    model = _sharded(path, seed=97)
    calls = {"n": 0}
    state_dict = model.state_dict

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return state_dict(*args, **kwargs)

    model.state_dict = counted  # type: ignore[method-assign]
    produced = {"n": 0}
    produce = FSDP2Adapter._produce

    def counted_produce(self: Any, names: Any) -> Any:
        produced["n"] += 1
        return produce(self, names)

    FSDP2Adapter._produce = counted_produce  # type: ignore[method-assign]
    target = load_tiny(path)
    sync = WeightSync("gloo", bucket_bytes=BUCKET, timeout_s=60)
    sync.add_replica(LocalEngine(target, name="refs"))
    res: dict[str, Any] = {}
    version = 0

    def push(case: str) -> None:
        nonlocal version
        version += 1
        before, made = calls["n"], produced["n"]
        report = sync.push(model, version)
        assert report.ok, report.error
        res[case] = {"walks": calls["n"] - before, "layout": report.layout,
                     "produced": produced["n"] - made, "bit_exact": _bit_exact(target, model)}

    push("first")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().mul_(1.5)
    push("trained in place")
    push("unchanged")

    # a parameter replaced by another object (same shape and dtype)
    mlp = model.model.layers[0].mlp.down_proj
    old = mlp.weight
    new = DTensor.from_local(old.to_local().clone() * -2, old.device_mesh, old.placements)
    mlp.weight = torch.nn.Parameter(new)
    push("replaced")
    push("after replaced")

    # the same parameter object, its local shard moved to other memory (`set_`): the
    # map holds, the recorded views would read the old memory: produced anew
    from enginehooks.trainer_side.state_refs import local_tensor

    shard = local_tensor(model.model.norm.weight)
    with torch.no_grad():
        shard.set_(shard.clone() * 5)
    push("storage moved")
    push("after storage moved")

    # a module left unsharded: FSDP2 registers its unsharded parameters meanwhile
    layer = model.model.layers[1]
    layer.unshard()
    push("unsharded")
    push("resharded")

    # a state-dict hook that changes entries: the map is never kept
    def scale_hook(module: Any, sd: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        key = f"{prefix}weight"
        if key in sd:
            sd[key] = sd[key] * 1  # a new tensor: the same values, another object

    model.model.norm._register_state_dict_hook(scale_hook)
    push("hooked")
    push("hooked again")
    sync.close()
    return res


if __name__ == "__main__":
    support_ranks.rank_main(globals())


def test_a_push_walks_the_model_only_when_the_walk_could_give_something_else(
        tiny_llama: Path, tmp_path: Path) -> None:
    (r,) = support_ranks.run_ranks(__file__, "cases", tmp_path, {"model": str(tiny_llama)},
                                   world=1, timeout_s=240)
    for case, got in r.items():
        if isinstance(got, dict):
            assert got["bit_exact"], (case, got)
    assert r["first"]["walks"] == 1 and r["first"]["produced"] > 0
    # trained in place, or not at all: the registered tensors are the ones the map holds,
    # and the stream is the last push's views replayed (nothing produced), whose bytes
    # are the trained ones (bit_exact above)
    assert r["trained in place"] == {"walks": 0, "layout": "prepared", "produced": 0,
                                     "bit_exact": True}
    assert r["unchanged"]["walks"] == 0 and r["unchanged"]["produced"] == 0
    # another object under a key: walked, produced anew, and the map and the record
    # rebuilt from that push
    assert r["replaced"]["walks"] == 1 and r["replaced"]["produced"] > 0
    assert r["after replaced"]["walks"] == 0 and r["after replaced"]["produced"] == 0
    # a local shard moved to other memory under the same parameter: the map holds, the
    # recorded views would read stale memory, so the stream is produced anew (and the
    # new bytes land: bit_exact), then recorded again
    assert r["storage moved"]["walks"] == 0 and r["storage moved"]["produced"] > 0
    assert r["after storage moved"]["produced"] == 0
    # FSDP2's unsharded parameters are other objects: walked (its hook reshards), then
    # the map of the resharded model holds again
    assert r["unsharded"]["walks"] == 1 and r["resharded"]["walks"] == 0
    assert r["unsharded"]["produced"] > 0
    # a hook added to a mapped model ends the map; entries that hooks replace cannot
    # be mapped: every push walks, once
    assert r["hooked"]["walks"] == 1 and r["hooked again"]["walks"] == 1
    assert r["hooked again"]["produced"] > 0


def test_the_map_refuses_a_swapped_dtype_or_shape_and_holds_nothing_alive() -> None:
    import gc
    import weakref

    import torch

    from enginehooks.trainer_side.state_refs import StateRefs, state_of

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    state, refs = state_of(model)
    assert refs is not None and list(state) == list(model.state_dict())
    again, same = state_of(model)
    assert same is refs and again["0.weight"] is model[0].weight
    with torch.no_grad():
        model[0].weight.data = model[0].weight.data.double()  # same object, other dtype
    assert refs.current() is None
    _, rebuilt = state_of(model)
    assert rebuilt is not refs and rebuilt is not None
    with torch.no_grad():
        model[1].bias.data = torch.zeros(5)  # same object, other shape
    assert rebuilt.current() is None
    # a persistent buffer is mapped, a non-persistent one is not (state_dict skips it)
    model[1].register_buffer("seen", torch.ones(2))
    model[1].register_buffer("scratch", torch.ones(2), persistent=False)
    state, refs = state_of(model)
    assert refs is not None and "1.seen" in state and "1.scratch" not in state
    # weak references only: the dropped model goes
    # the tree: a child replaced, a tensor added, a hook registered each end the map
    _, refs = state_of(model)
    assert refs is not None and refs.current() is not None
    model[1] = torch.nn.LayerNorm(3)
    assert refs.current() is None
    _, refs = state_of(model)
    assert refs is not None
    model[0].register_parameter("extra", torch.nn.Parameter(torch.ones(1)))
    assert refs.current() is None
    _, refs = state_of(model)
    assert refs is not None
    model[0].register_state_dict_post_hook(lambda *a: None)
    assert refs.current() is None
    gone = weakref.ref(model[0].weight)
    del model, state, again, refs, rebuilt, same
    gc.collect()
    assert gone() is None
    # a map is built only from a state dict whose every entry is the registered tensor
    m2 = torch.nn.Linear(2, 2)
    sd = m2.state_dict()
    sd["weight"] = sd["weight"].clone()
    assert StateRefs.build(m2, sd) is None
    assert StateRefs.build(m2, {"bias": sd["bias"], "weight": sd["weight"]}) is None
