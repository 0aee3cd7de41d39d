"""Trainer side: adapters that turn a training model into a lazy HF-named stream.

Every trainer rank must iterate an adapter's stream in lockstep when producing a
tensor is a collective (sharded trainers); only the sender rank transmits. Non-sender
ranks call `follow(model)`, or every rank calls `push(model, version, sync=...)`
(`sync` only on the sender); see docs/trainers.md and `lockstep.py` for the go/no-go
handshake that keeps a failed push from leaving ranks inside a collective.
"""

from __future__ import annotations

from collections.abc import Callable

from enginehooks.plugins import hookimpl
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
from enginehooks.trainer_side.module import ModuleAdapter, StateDictAdapter, hf_name

__all__ = [
    "FSDP1Adapter",
    "FSDP2Adapter",
    "LockstepAdapter",
    "LockstepError",
    "MegatronBridgeAdapter",
    "ModuleAdapter",
    "PeftAdapter",
    "PushAborted",
    "StateDictAdapter",
    "follow",
    "hf_name",
    "push",
]


@hookimpl
def register_trainer_adapters(register: Callable[[type], None]) -> None:
    # First match wins: the specific adapters before the plain-module fallback (an
    # FSDP, PEFT or Megatron model is an nn.Module too).
    register(MegatronBridgeAdapter)
    register(PeftAdapter)
    register(FSDP1Adapter)
    register(FSDP2Adapter)
    register(ModuleAdapter)
    register(StateDictAdapter)
