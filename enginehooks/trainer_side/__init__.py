"""Trainer side: adapters that turn a training model into a lazy HF-named stream.

Every trainer rank must iterate an adapter's stream in lockstep when producing a
tensor is a collective (sharded trainers); only the sender rank transmits.
"""

from __future__ import annotations

from collections.abc import Callable

from enginehooks.plugins import hookimpl
from enginehooks.trainer_side.module import ModuleAdapter, hf_name

__all__ = ["ModuleAdapter", "hf_name"]


@hookimpl
def register_trainer_adapters(register: Callable[[type], None]) -> None:
    register(ModuleAdapter)
