"""A `{name: tensor}` trainer (`StateDictAdapter`) keeps a prepared layout (issue 37 item
1): a training loop that pushes a new dict of the same names, shapes and dtypes every
step makes one signed call per replica, as a module trainer does; a dict with another
shape, another dtype, another tensor or another order plans in full again (and the
replica still refuses what it would refuse)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from enginehooks import ManifestError, WeightSync
from enginehooks.engine.local import LocalEngine
from enginehooks.trainer_side.module import StateDictAdapter


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))


def weights(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in net(seed).state_dict().items()}


def test_the_key_is_the_layout_not_the_values() -> None:
    a, b = StateDictAdapter(weights(1)), StateDictAdapter(weights(2))
    assert a.layout_key() == b.layout_key() and a.reuse_plan(b, a.specs())
    reordered = dict(reversed(list(weights(1).items())))
    other_shape = {**weights(1), "1.bias": torch.zeros(9)}
    other_dtype = {k: v.double() for k, v in weights(1).items()}
    other_wire = StateDictAdapter(weights(1), dtype=torch.bfloat16)
    keys = {StateDictAdapter(w).layout_key() for w in (reordered, other_shape, other_dtype)}
    assert a.layout_key() not in keys | {other_wire.layout_key()} and len(keys) == 3


def test_a_dict_trainer_pushes_on_the_prepared_layout() -> None:
    replicas = [LocalEngine(net(0), name=f"r{i}") for i in range(2)]
    with WeightSync("gloo", timeout_s=20) as sync:
        for r in replicas:
            sync.add_replica(r)
        assert sync.push(weights(1), 1).layout == "planned"
        for version in (2, 3):
            sent = weights(version)
            report = sync.push(sent, version)
            assert report.ok and report.layout == "prepared"
            assert [res.rpcs for res in report.replicas] == [1, 1]
            for r in replicas:
                got = r.target.module.state_dict()
                assert all(torch.equal(got[k], sent[k]) for k in sent)
                assert r.side.version == version and r.side.state == "current"
        # a tensor the replica does not have: the full path, refused before any byte
        with pytest.raises(ManifestError) as e:
            sync.push({**weights(4), "bonus": torch.ones(3)}, 4)
        assert e.value.report.layout == "planned"
        assert all(r.side.version == 3 and r.side.state == "current" for r in replicas)
