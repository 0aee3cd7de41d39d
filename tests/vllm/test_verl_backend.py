"""verl's checkpoint engine "enginehooks" (`enginehooks/verl_ext/`) driven by verl itself,
as verl tests its own backends (its `tests/checkpoint_engine/test_correctness_on_gpu.py`,
here on CPU over gloo): verl's `CheckpointEngineManager` syncs two trainer ranks into
two rollout replicas (verl's own `CheckpointEngineWorker`) in Ray, several rounds, and
every replica holds the trainer's weights of that round bit for bit. The weights cross
in signed, digested buckets (a shared secret is set in every worker).

verl runs in the vLLM environment, installed without its dependencies
(`scripts/setup-vllm-env.sh`); skipped where it is not installed.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("verl.checkpoint_engine", reason="verl is not installed in this environment")
ray = pytest.importorskip("ray", reason="Ray is not installed in this environment")

from verl.checkpoint_engine import (  # noqa: E402
    CheckpointEngineManager,
    CheckpointEngineRegistry,
)
from verl.single_controller.ray import (  # noqa: E402
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
)
from verl.workers.config import CheckpointEngineConfig, RolloutConfig  # noqa: E402
from verl.workers.rollout import RolloutReplica  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = (1, 2, 3)


class Replica(RolloutReplica):
    """A rollout replica whose workers are the rollout group's (verl's test does the
    same: `MockReplica.init_hybrid`); it starts no server."""

    async def init_hybrid(self, worker_group: RayWorkerGroup) -> None:
        n = self.world_size
        self.workers = worker_group.workers[n * self.replica_rank: n * (self.replica_rank + 1)]

    def get_ray_class_with_init_args(self) -> RayClassWithInitArgs:
        raise NotImplementedError

    async def launch_servers(self) -> None:
        raise NotImplementedError


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    path = [str(ROOT), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(path)),
           "ENGINEHOOKS_SECRET": "verl-backend-test-secret", "HF_HUB_OFFLINE": "1"}
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=128 << 20,
             runtime_env={"env_vars": env}, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def _groups(config: CheckpointEngineConfig) -> tuple[RayWorkerGroup, RayWorkerGroup,
                                                       list[Replica]]:
    from tests.vllm.verl_workers import RolloutWorker, TrainerWorker

    rollout_config = RolloutConfig(name="vllm", checkpoint_engine=config)
    trainer = RayWorkerGroup(
        resource_pool=RayResourcePool([2], use_gpu=False, max_colocate_count=1),
        ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(TrainerWorker),
                                               checkpoint_engine_config=config),
        device_name="cpu")
    rollout = RayWorkerGroup(
        resource_pool=RayResourcePool([2], use_gpu=False, max_colocate_count=1),
        ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(RolloutWorker),
                                               rollout_config=rollout_config),
        device_name="cpu")
    replicas = [Replica(replica_rank=i, config=rollout_config, model_config=None)
                for i in range(2)]
    for r in replicas:
        asyncio.run(r.init_hybrid(rollout))
    return trainer, rollout, replicas


def test_verl_syncs_weights_through_enginehooks(cluster: Any) -> None:
    """Three rounds through verl's manager: each replica equals the trainer's weights of
    that round (names, dtypes, shapes, bytes), a tensor larger than a bucket included."""
    config = CheckpointEngineConfig(
        backend="enginehooks", update_weights_bucket_megabytes=1,
        custom_backend_module="enginehooks.verl_ext.checkpoint_engine",
        engine_kwargs={"enginehooks": {"transport": "gloo", "host": "127.0.0.1",
                                       "timeout_s": 60}})
    trainer, rollout, replicas = _groups(config)
    manager = CheckpointEngineManager(config=config, actor_wg=trainer, replicas=replicas)
    from tests.vllm.verl_workers import weights_for

    for step in ROUNDS:
        want = sum(t.nbytes for t in weights_for(step).values())
        metrics = manager.update_weights(global_steps=step)
        assert rollout.check_weights(step) == [[], []], f"round {step}"
        assert metrics["enginehooks/bytes"] == want and metrics["enginehooks/segments"] >= 2


_SAME = b"<the sender's>"


def _sync_in_threads(sender_secret: bytes | None, receiver_secret: bytes | None,
                     weights: dict[str, Any], header_secret: bytes | None = _SAME,
                     timeout_s: float = 20) -> tuple[Any, Any]:
    """One sync between a trainer rank 0 and one rollout worker of this process, each on
    a thread of its own with its own secret (`secret_scope`): the steps verl's manager
    drives, in its order. `header_secret`: the key the trainer signs its segment
    manifests with, if not the one its group was formed with. Returns (what the sender
    raised or returned, what the receiver raised or received)."""
    import threading

    from enginehooks.core.auth import secret_scope
    from enginehooks.verl_ext.checkpoint_engine import EngineHooksCheckpointEngine as Engine

    kwargs = {"bucket_size": 1 << 20, "transport": "gloo", "host": "127.0.0.1",
              "timeout_s": timeout_s}
    with secret_scope(sender_secret):
        trainer = Engine(is_master=True, **kwargs)
        meta = [trainer.prepare()]
    if header_secret is not _SAME:
        trainer.secret = header_secret
    with secret_scope(receiver_secret):
        rollout = Engine(**kwargs)
        meta.append(rollout.prepare())
    actor_kw, rollout_kw = Engine.build_topology(1, 1, meta)
    out: dict[str, Any] = {}

    def side(name: str, secret: bytes | None, engine: Engine, kw: dict[str, Any]) -> None:
        async def receive() -> dict[str, Any]:
            return {n: t.clone() async for n, t in engine.receive_weights(global_steps=1)}

        try:
            with secret_scope(secret):
                engine.init_process_group(**{k: v[0] for k, v in kw.items()})
                if name == "sender":
                    out[name] = asyncio.run(engine.send_weights(iter(weights.items()), 1))
                else:
                    out[name] = asyncio.run(receive())
        except Exception as e:
            out[name] = e
        finally:
            engine.finalize()

    threads = [threading.Thread(target=side, args=("sender", sender_secret, trainer, actor_kw)),
               threading.Thread(target=side, args=("receiver", receiver_secret, rollout,
                                                   rollout_kw))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    trainer._close()
    rollout._close()
    return out["sender"], out["receiver"]


@pytest.mark.parametrize(("header_secret", "why"), [
    (b"another-secret", "does not match"),
    (None, "no valid authentication token"),
])
def test_an_unsigned_or_wrongly_signed_segment_is_refused_before_any_tensor(
        header_secret: bytes | None, why: str) -> None:
    """A rollout worker refuses a segment whose manifest its trainer did not sign with
    the group's secret: nothing reaches verl's server adapter, the worker leaves the
    group, and the trainer's send fails within `timeout_s` instead of hanging (verl's
    contract has no channel from a rollout worker back to the trainer, so the trainer
    learns of the refusal from its broadcast's timeout)."""
    from enginehooks.core.auth import AuthError
    from enginehooks.core.errors import EngineHooksError
    from tests.vllm.verl_workers import weights_for

    sent, received = _sync_in_threads(b"group-secret", b"group-secret", weights_for(1),
                                      header_secret=header_secret, timeout_s=4)
    assert isinstance(received, AuthError) and why in str(received), received
    assert isinstance(sent, EngineHooksError), sent


def test_a_rollout_worker_with_another_secret_never_joins() -> None:
    """Secrets that differ stop the sync earlier, at the group's signed rendezvous
    (`transports/_rendezvous.py`): neither side moves a byte, both fail."""
    from enginehooks.core.errors import EngineHooksError
    from tests.vllm.verl_workers import weights_for

    sent, received = _sync_in_threads(b"trainer-secret", b"another-secret", weights_for(1),
                                      timeout_s=3)
    assert isinstance(received, EngineHooksError) and "ENGINEHOOKS_SECRET" in str(received)
    assert isinstance(sent, EngineHooksError), sent


@pytest.mark.parametrize("secret", [b"one-secret", None])
def test_the_same_secret_on_both_sides_syncs_bit_for_bit(secret: bytes | None) -> None:
    """The control for the refusals above: the same threads with one secret deliver, and
    so do they with none on either side (digests only)."""
    from tests.vllm.verl_workers import weights_for

    want = weights_for(1)
    sent, received = _sync_in_threads(secret, secret, want)
    assert not isinstance(received, Exception), received
    assert sent["enginehooks/bytes"] == sum(t.nbytes for t in want.values())
    assert sorted(received) == sorted(want)
    for name, t in want.items():
        assert received[name].dtype == t.dtype and torch.equal(received[name], t), name


def test_the_entry_point_registers_the_backend_by_name() -> None:
    """What `import verl` loads (the `verl.plugins` entry point this package declares)
    registers "enginehooks", so `checkpoint_engine.backend: enginehooks` alone selects it
    once enginehooks is installed."""
    import tomllib

    from enginehooks.verl_ext import register
    from enginehooks.verl_ext.checkpoint_engine import EngineHooksCheckpointEngine

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["verl.plugins"] == {
        "enginehooks": "enginehooks.verl_ext:register"}
    register()
    assert CheckpointEngineRegistry.get("enginehooks") is EngineHooksCheckpointEngine
