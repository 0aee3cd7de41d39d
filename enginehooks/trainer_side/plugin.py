"""The built-in trainer adapters, registered as a plugin like any third-party one."""

from __future__ import annotations

from collections.abc import Callable

from enginehooks.markers import hookimpl
from enginehooks.trainer_side.contract import TrainerAdapter
from enginehooks.trainer_side.fsdp import FSDP1Adapter, FSDP2Adapter
from enginehooks.trainer_side.lora import PeftAdapter
from enginehooks.trainer_side.megatron import MegatronBridgeAdapter
from enginehooks.trainer_side.module import ModuleAdapter, StateDictAdapter


@hookimpl
def register_trainer_adapters(register: Callable[[type[TrainerAdapter]], None]) -> None:
    # First match wins: the specific adapters before the plain-module fallback (an
    # FSDP, PEFT or Megatron model is an nn.Module too).
    for cls in (MegatronBridgeAdapter, PeftAdapter, FSDP1Adapter, FSDP2Adapter, ModuleAdapter,
                StateDictAdapter):
        register(cls)
