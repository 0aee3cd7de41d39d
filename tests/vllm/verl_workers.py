"""verl's worker processes for the "enginehooks" checkpoint-engine test, as verl tests
its own backends (`tests/checkpoint_engine/test_utils.py` in verl): trainer ranks that
send through the backend, and verl's own `CheckpointEngineWorker` on the rollout side
with a server adapter that records what it was given. Ray's workers import it by
module name (`tests.vllm.verl_workers`); it needs verl, so only the verl test imports it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import torch
from verl.checkpoint_engine import CheckpointEngineRegistry, CheckpointEngineWorker
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.import_utils import import_external_libs
from verl.workers.rollout import BaseRollout

#: name -> (dtype, shape): a small model's tensors, one larger than a bucket (cut
#: across buckets), one half-precision, one integer buffer, one empty.
SHAPES: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
    "model.embed_tokens.weight": (torch.float32, (2048, 160)),  # 1.25 MiB: > a bucket
    "model.layers.0.self_attn.q_proj.weight": (torch.bfloat16, (96, 96)),
    "model.layers.0.mlp.up_proj.weight": (torch.float32, (128, 96)),
    "model.layers.0.input_layernorm.weight": (torch.float32, (96,)),
    "model.rotary.position_ids": (torch.int64, (64,)),
    "model.empty": (torch.float32, (0, 4)),
    "lm_head.weight": (torch.float16, (2048, 160)),
}


def weights_for(step: int) -> dict[str, torch.Tensor]:
    """The trainer's weights after `step` (a seeded function: every rank and the check
    agree on them bit for bit)."""
    g = torch.Generator().manual_seed(1000 + step)
    out = {}
    for name, (dtype, shape) in SHAPES.items():
        if dtype.is_floating_point:
            out[name] = torch.randn(shape, generator=g).to(dtype)
        else:
            out[name] = torch.randint(0, 1 << 40, shape, generator=g, dtype=dtype)
    return out


class TrainerWorker(Worker):
    """A trainer rank: builds the backend as verl's actor does (`is_master` on rank 0)."""

    def __init__(self, checkpoint_engine_config: Any) -> None:
        super().__init__()
        cfg = checkpoint_engine_config
        import_external_libs(cfg.custom_backend_module or None)
        kwargs = dict(cfg.engine_kwargs.get(cfg.backend, {}))
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            cfg.backend, bucket_size=cfg.update_weights_bucket_megabytes << 20,
            is_master=self.rank == 0, **kwargs)
        self.corrupt_at: int | None = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> Any:
        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            yield from weights_for(int(global_steps or 0)).items()

        return await self.checkpoint_engine.send_weights(stream(), global_steps=global_steps)

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)


class RecordingAdapter(BaseRollout):
    """verl's server adapter, standing in for the engine: keeps a copy of every tensor
    (the backend's tensors are views valid until the next is asked for)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config, None, device_mesh=None)
        self.received: dict[str, torch.Tensor] = {}
        self.steps: int | None = None

    async def resume(self, tags: list[str]) -> None:
        raise NotImplementedError

    async def release(self) -> None:
        raise NotImplementedError

    async def update_weights(self, weights: AsyncIterator[tuple[str, torch.Tensor]],
                             **kwargs: Any) -> None:
        self.received = {}
        self.steps = kwargs.get("global_steps")
        async for name, tensor in weights:
            self.received[name] = tensor.clone()


class RolloutWorker(CheckpointEngineWorker):
    """verl's own rollout-side worker around the recording adapter."""

    def __init__(self, rollout_config: Any) -> None:
        super().__init__(rollout_config, None, RecordingAdapter(rollout_config))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def check_weights(self, step: int) -> list[str]:
        """What differs from the trainer's weights at `step`, bit for bit (empty: all
        equal, same names, dtypes and shapes)."""
        want, got = weights_for(step), self.server_adapter.received
        bad = sorted(set(want) ^ set(got))
        for name in set(want) & set(got):
            w, g = want[name], got[name]
            if w.dtype != g.dtype or w.shape != g.shape or not torch.equal(
                    w.view(-1).view(torch.uint8), g.contiguous().view(-1).view(torch.uint8)):
                bad.append(name)
        if self.server_adapter.steps != step:
            bad.append(f"global_steps {self.server_adapter.steps} != {step}")
        return bad
