"""Trainer side: adapters that turn a training model into a lazy update stream in
checkpoint format.

The contract every adapter implements is `TrainerAdapter` (`contract.py`); the
checkpoint format comes from transformers' own conversion (`core/checkpoint_format.py`).
Every trainer rank must iterate an adapter's stream in lockstep when producing a
tensor is a collective (sharded trainers); only the sender rank transmits. Non-sender
ranks call `follow(model)`, or every rank calls `push(model, version, sync=...)`
(`sync` only on the sender); see docs/trainers.md and `lockstep.py` for the go/no-go
handshake that keeps a failed push from leaving ranks inside a collective. The trainer
ranks talk over one channel (`channel.py`: `TrainerRanks` and its typed messages), for
the lockstep's flags and for the commands of several senders (`WeightSync(senders=...)`).
"""

from __future__ import annotations

from enginehooks.core.checkpoint_format import CheckpointFormat
from enginehooks.trainer_side.channel import TrainerRanks
from enginehooks.trainer_side.choose import adapter_for
from enginehooks.trainer_side.contract import (
    CheckpointAdapter,
    TrainerAdapter,
    hf_name,
)
from enginehooks.trainer_side.fsdp import FSDP1Adapter, FSDP2Adapter
from enginehooks.trainer_side.lockstep import (
    LockstepAdapter,
    LockstepError,
    PushAborted,
    follow,
    push,
)
from enginehooks.trainer_side.lora import PeftAdapter
from enginehooks.trainer_side.megatron import MegatronBridgeAdapter
from enginehooks.trainer_side.module import ModuleAdapter, StateDictAdapter

__all__ = [
    "CheckpointAdapter",
    "CheckpointFormat",
    "FSDP1Adapter",
    "FSDP2Adapter",
    "LockstepAdapter",
    "LockstepError",
    "MegatronBridgeAdapter",
    "ModuleAdapter",
    "PeftAdapter",
    "PushAborted",
    "StateDictAdapter",
    "TrainerAdapter",
    "TrainerRanks",
    "adapter_for",
    "follow",
    "hf_name",
    "push",
]
