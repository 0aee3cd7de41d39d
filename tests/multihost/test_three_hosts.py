"""One trainer, two engine hosts (three namespaces on one switch): a gloo group that
spans three machines, and one engine host lost in the middle of a push.

The push fails on every side within its timeouts; neither replica is `current` on the
failed version (a broadcast stalls for every receiver when one stops taking bytes);
once the link heals the next push lands on both, bit for bit. The push's error names the
lost replica (which never answered), not the healthy one that answered first with an
error its closed connection caused."""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from enginehooks_testkit.netns import Network
from enginehooks_testkit.tiny import load_tiny, perturb
from tests.multihost.conftest import ModuleReplica, TrainerProcess
from tests.multihost.test_gloo_across_hosts import (
    REPLICA_MARGIN_S,
    SHAPED_KBIT,
    TIMEOUT_S,
    TRAINER_MARGIN_S,
)

HOSTS = ["trainer", "engine-a", "engine-b"]


@pytest.fixture(scope="module")
def net3(netns_ok: None) -> Iterator[Network]:
    with Network(HOSTS) as network:
        yield network


@pytest.fixture(scope="module")
def replicas(net3: Network, module_model: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[dict[str, ModuleReplica]]:
    started: dict[str, ModuleReplica] = {}
    try:
        for name in HOSTS[1:]:
            started[name] = ModuleReplica(net3.hosts[name], module_model,
                                          tmp_path_factory.mktemp(name))
        yield started
    finally:
        for r in started.values():
            r.close()


@pytest.fixture(scope="module")
def trainer3(net3: Network, replicas: dict[str, ModuleReplica], module_model: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainerProcess]:
    spec = {"model_dir": str(module_model), "host": net3.hosts["trainer"].address,
            "replicas": [{"kind": "module", "url": r.url, "name": r.name}
                         for r in replicas.values()],
            "timeout_s": TIMEOUT_S, "bucket_bytes": 256 << 10}
    proc = TrainerProcess(net3.hosts["trainer"], spec,
                          tmp_path_factory.mktemp("trainer3") / "trainer.log")
    try:
        yield proc
    finally:
        proc.close()


def assert_both_hold(trainer: TrainerProcess, replicas: dict[str, ModuleReplica],
                     module_model: Path, seed: int, version: str) -> None:
    model = perturb(load_tiny(module_model), seed=seed)
    want = {n: zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy())
            for n, t in model.state_dict().items()}
    for r in replicas.values():
        s = r.state()
        assert s["state"] == "current" and s["version"] == version, (r.name, s)
        got = trainer.call({"op": "digests", "names": sorted(want), "replica": r.name})
        assert {n: d["crc32"] for n, d in got["digests"].items()} == want, r.name


def test_an_engine_host_lost_mid_push_fails_the_push_and_the_next_push_heals_both(
        net3: Network, trainer3: TrainerProcess, replicas: dict[str, ModuleReplica],
        module_model: Path) -> None:
    out = trainer3.call({"op": "push", "seed": 30, "version": "three-1"})
    assert out["ok"], out
    assert_both_hold(trainer3, replicas, module_model, seed=30, version="three-1")

    lost = net3.hosts["engine-b"]
    for host in HOSTS[1:]:
        net3.hosts[host].shape(SHAPED_KBIT)
    try:
        trainer3.send({"op": "push", "seed": 31, "version": "three-failed"})
        replicas["engine-b"].wait_state(lambda s: s.get("updating_to") == "three-failed",
                                        60.0, "started receiving")
        time.sleep(1.0)
        lost.down()
        t_fault, wall_fault = time.monotonic(), time.time()
        out = trainer3.answer(TIMEOUT_S + TRAINER_MARGIN_S + 30.0)
        trainer_s = time.monotonic() - t_fault
        ended = {name: r.wait_state(lambda s: s.get("state") != "updating",
                                    TIMEOUT_S + REPLICA_MARGIN_S, "ended the update")
                 for name, r in replicas.items()}
    finally:
        for host in HOSTS[1:]:
            net3.hosts[host].heal()
    print(f"three hosts, engine-b lost: trainer ended after {trainer_s:.1f}s: "
          f"{out.get('type')}: {out.get('error')}; " + "; ".join(
              f"{n} {s['state']} after {s['time'] - wall_fault:.1f}s" for n, s in ended.items()))
    assert not out["ok"], out
    # The lost engine-b is the cause, and is named first; the healthy engine-a, whose
    # connection the sender closed, answered first, and is listed after it.
    lost_name = replicas["engine-b"].name
    assert out["replica"] == lost_name, out
    assert out["error"].startswith(f"replica {lost_name!r}: "), out
    assert trainer_s <= TIMEOUT_S + TRAINER_MARGIN_S, (trainer_s, out)
    for name, s in ended.items():
        assert s["time"] - wall_fault <= TIMEOUT_S + REPLICA_MARGIN_S, (name, s)
        assert not (s["state"] == "current" and s["version"] == "three-failed"), (name, s)
    assert ended["engine-b"]["state"] == "torn", ended

    # Healed: the next push lands on both (a late leave of the failed push is ignored).
    out = trainer3.call({"op": "push", "seed": 32, "version": "three-healed"})
    assert out["ok"], out
    assert_both_hold(trainer3, replicas, module_model, seed=32, version="three-healed")
