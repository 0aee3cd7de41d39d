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

pytest.importorskip("verl.checkpoint_engine", reason="verl is not installed in this environment")
ray = pytest.importorskip("ray", reason="Ray is not installed in this environment")

from verl.checkpoint_engine import CheckpointEngineManager  # noqa: E402
from verl.single_controller.ray import (  # noqa: E402
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
)
from verl.workers.config import CheckpointEngineConfig, RolloutConfig  # noqa: E402
from verl.workers.rollout import RolloutReplica  # noqa: E402

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
    from enginehooks_testkit.verl_workers import RolloutWorker, TrainerWorker

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
    from enginehooks_testkit.verl_workers import weights_for

    for step in ROUNDS:
        want = sum(t.nbytes for t in weights_for(step).values())
        metrics = manager.update_weights(global_steps=step)
        assert rollout.check_weights(step) == [[], []], f"round {step}"
        assert metrics["enginehooks/bytes"] == want and metrics["enginehooks/segments"] >= 2
