"""vLLM's `vllm.general_plugins` entry point: registers backend "enginehooks" with
vLLM's weight-transfer factories.

vLLM loads general plugins in every one of its processes (API server, engine core,
workers), sometimes more than once, so registering is idempotent. Both sides are
registered lazily, by module path: no vLLM process imports the trainer side, nor a
trainer the worker side. The trainer side also registers itself when its module is
imported, since a trainer process does not load vLLM's plugins.

Select it with `LLM(..., weight_transfer_config={"backend": "enginehooks"})` or
`--weight-transfer-config '{"backend": "enginehooks"}'`.

Because it runs in every vLLM process, it is also where a process asks for AMX tile
permission, which vLLM's own CPU kernels need and do not ask for (`cpu_amx`).
"""

from __future__ import annotations

from typing import Any

from enginehooks.core.errors import PluginError

BACKEND = "enginehooks"
WORKER_SIDE = ("enginehooks.vllm_ext.transfer_engine", "EnginehooksWeightTransferEngine")
TRAINER_SIDE = ("enginehooks.vllm_ext.transfer_trainer", "EnginehooksTrainerWeightTransferEngine")


def register() -> None:
    """Register both sides of backend "enginehooks" (the entry point's function), and
    let this process use AMX before vLLM's CPU kernels do (`cpu_amx`)."""
    from enginehooks.vllm_ext.cpu_amx import allow_amx

    allow_amx()
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    _register(WeightTransferEngineFactory, *WORKER_SIDE)
    _register(WeightTransferTrainerFactory, *TRAINER_SIDE)


def _register(factory: Any, module: str, cls: str) -> None:
    try:
        factory.register_engine(BACKEND, module, cls)
    except ValueError:  # already registered: by us (a second load) or by someone else
        loader = getattr(factory, "_registry", {}).get(BACKEND)
        found = loader() if loader is not None else None
        if found is not None and (found.__module__, found.__name__) != (module, cls):
            raise PluginError(f"vLLM weight-transfer backend {BACKEND!r} is already taken by "
                              f"{found.__module__}.{found.__name__}") from None
