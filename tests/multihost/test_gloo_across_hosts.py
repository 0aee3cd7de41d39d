"""gloo pushes across hosts (network namespaces, `conftest.py`): a trainer on 10.78.0.1
pushes into a module replica served on 10.78.0.2, through the receiver code every
engine plugin runs.

- The push lands, bit for bit (the receiver binds its own address, not the trainer's:
  before that fix every cross-host push failed with "Cannot resolve 10.78.0.1 to a
  (local) address").
- Network faults in the middle of a push: the link drops every packet, its latency
  jumps to seconds, the engine's host disappears. Each ends the push on every side
  with an error naming the replica (the replica within `timeout_s`, the trainer within
  `timeout_s` plus the coordinator's 5 s grace for the replica's own error); the
  replica is torn, never `current` on the version that failed; once the link is healed
  the next push succeeds and the replica holds exactly the trainer's weights (a leave
  of the failed push that the healed link delivers late is ignored by the worker).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from enginehooks_testkit.netns import Host, Network
from enginehooks_testkit.tiny import load_tiny, perturb
from tests.multihost.conftest import ENGINE, TRAINER, ModuleReplica, TrainerProcess

#: Every data-plane wait of a push (`WeightSync(timeout_s=...)`).
TIMEOUT_S = 8.0
#: How long past `timeout_s` the trainer's push may take to fail: the coordinator gives
#: the replicas up to 5 s after the sender's own error to report theirs (which names the
#: bucket), and a partitioned replica's receive RPC ends at `timeout_s + 5`
#: (`control/sync.py`), plus scheduling on a loaded 2-core machine.
TRAINER_MARGIN_S = 5.0 + 2.0
#: How long past `timeout_s` the replica may take to end its update (its receive waits
#: `timeout_s` per bucket), plus scheduling.
REPLICA_MARGIN_S = 2.0
#: The link's rate while a fault is injected: a 10 MB push then takes about 5 s.
SHAPED_KBIT = 16_000


@pytest.fixture(scope="module")
def trainer(net: Network, module_replica: ModuleReplica, module_model: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainerProcess]:
    spec = {"model_dir": str(module_model), "host": net.hosts[TRAINER].address,
            "replica": {"kind": "module", "url": module_replica.url,
                        "name": module_replica.name},
            "timeout_s": TIMEOUT_S, "bucket_bytes": 256 << 10}
    proc = TrainerProcess(net.hosts[TRAINER], spec,
                          tmp_path_factory.mktemp("trainer") / "trainer.log")
    try:
        yield proc
    finally:
        proc.close()


@pytest.fixture(scope="module")
def expected(module_model: Path) -> Callable[[int], dict[str, int]]:
    """crc32 of every tensor of the trainer's model after `perturb(seed)`."""
    def crcs(seed: int) -> dict[str, int]:
        model = perturb(load_tiny(module_model), seed=seed)
        return {n: zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy())
                for n, t in model.state_dict().items()}
    return crcs


def assert_holds(trainer: TrainerProcess, expected: Callable[[int], dict[str, int]],
                 seed: int) -> None:
    want = expected(seed)
    got = trainer.call({"op": "digests", "names": sorted(want)})
    assert got["ok"], got
    assert {n: d["crc32"] for n, d in got["digests"].items()} == want


def push_ok(trainer: TrainerProcess, replica: ModuleReplica, seed: int, version: str) -> None:
    out = trainer.call({"op": "push", "seed": seed, "version": version})
    assert out["ok"], out
    s = replica.state()
    assert s["state"] == "current" and s["version"] == version, s


def push_after_heal(trainer: TrainerProcess, replica: ModuleReplica, seed: int,
                    version: str) -> None:
    """The first push after a partition healed succeeds. The coordinator's `leave` of
    the failed push, sent while the link was down, may be delivered by TCP's
    retransmission after this push's `join`: it names the group it leaves, and the
    worker, in the new group by then, ignores it (`EngineSide.leave`)."""
    push_ok(trainer, replica, seed=seed, version=version)


def test_push_across_hosts_lands_bit_for_bit(
        net: Network, trainer: TrainerProcess, module_replica: ModuleReplica,
        expected: Callable[[int], dict[str, int]]) -> None:
    push_ok(trainer, module_replica, seed=1, version="across-1")
    assert_holds(trainer, expected, seed=1)
    # and again through the same group (two pushes, one WeightSync)
    push_ok(trainer, module_replica, seed=2, version="across-2")
    assert_holds(trainer, expected, seed=2)


FAULTS: dict[str, Callable[[Host], None]] = {
    "link-drops-every-packet": Host.blackhole,
    "latency-jumps-to-seconds": lambda h: h.latency(3.0),
    "engine-host-disappears": Host.down,
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_fault_mid_push_ends_every_side_in_time_and_the_next_push_heals(
        fault: str, net: Network, trainer: TrainerProcess, module_replica: ModuleReplica,
        expected: Callable[[int], dict[str, int]]) -> None:
    engine = net.hosts[ENGINE]
    push_ok(trainer, module_replica, seed=10, version=f"{fault}-before")
    engine.shape(SHAPED_KBIT)
    failed_version = f"{fault}-failed"
    try:
        trainer.send({"op": "push", "seed": 11, "version": failed_version})
        module_replica.wait_state(lambda s: s.get("updating_to") == failed_version, 60.0,
                                  f"started receiving {failed_version}")
        time.sleep(1.0)  # some buckets are through; most are not (about 5 s at this rate)
        assert module_replica.state()["state"] == "updating", "the push ended before the fault"
        FAULTS[fault](engine)
        t_fault, wall_fault = time.monotonic(), time.time()
        out = trainer.answer(TIMEOUT_S + TRAINER_MARGIN_S + 30.0)
        trainer_s = time.monotonic() - t_fault
        after = module_replica.wait_state(lambda s: s.get("state") != "updating",
                                          TIMEOUT_S + REPLICA_MARGIN_S, "ended the update")
        replica_s = after["time"] - wall_fault  # when the replica published its new state
    finally:
        engine.heal()
    print(f"{fault}: trainer ended after {trainer_s:.1f}s, replica after {replica_s:.1f}s: "
          f"{out.get('type')}: {out.get('error')}; replica {after['state']}: {after['reason']}")
    assert not out["ok"], out
    assert module_replica.name in out["error"] or out.get("replica") == module_replica.name, out
    assert trainer_s <= TIMEOUT_S + TRAINER_MARGIN_S, (trainer_s, out)
    assert replica_s <= TIMEOUT_S + REPLICA_MARGIN_S, (replica_s, after)
    assert not (after["state"] == "current" and after["version"] == failed_version), after
    assert after["state"] == "torn" and after["failed_version"] == failed_version, after

    # Healed: the next push succeeds, and the replica holds exactly the trainer's weights.
    push_after_heal(trainer, module_replica, seed=12, version=f"{fault}-healed")
    assert_holds(trainer, expected, seed=12)


def test_partition_before_data_moves_fails_in_time_and_changes_nothing(
        net: Network, trainer: TrainerProcess, module_replica: ModuleReplica,
        expected: Callable[[int], dict[str, int]]) -> None:
    """The link drops every packet before the push starts: the push's first control
    calls (`info`, then `check`) get no answer, the push fails within `timeout_s` naming
    the replica, no byte moved, and the replica stays current on its version."""
    engine = net.hosts[ENGINE]
    push_ok(trainer, module_replica, seed=20, version="partition-before")
    engine.blackhole()
    try:
        t0 = time.monotonic()
        out = trainer.call({"op": "push", "seed": 21, "version": "partition-failed"},
                           timeout_s=TIMEOUT_S + TRAINER_MARGIN_S + 30.0)
        trainer_s = time.monotonic() - t0
        state = module_replica.state()
    finally:
        engine.heal()
    print(f"partition before data moves: trainer ended after {trainer_s:.1f}s: "
          f"{out.get('type')}: {out.get('error')}")
    assert not out["ok"], out
    assert module_replica.name in out["error"] or out.get("replica") == module_replica.name, out
    assert trainer_s <= TIMEOUT_S + TRAINER_MARGIN_S, (trainer_s, out)
    assert state["state"] == "current" and state["version"] == "partition-before", state
    assert_holds(trainer, expected, seed=20)

    push_after_heal(trainer, module_replica, seed=22, version="partition-healed")
    assert_holds(trainer, expected, seed=22)
