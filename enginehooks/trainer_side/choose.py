"""`adapter_for`: the adapter of a model, chosen among the registered ones (plugins'
before the built-ins). Apart from the contract (`contract.py`) because it asks the
plugin manager, which names the contract's classes in its types: the contract imports
no plugin machinery, so no import circle runs through it, not even for type checking.
"""

from __future__ import annotations

from typing import Any

from enginehooks.core.errors import PluginError
from enginehooks.plugins import trainer_adapters
from enginehooks.trainer_side.contract import TrainerAdapter


def adapter_for(model: Any, **kwargs: Any) -> TrainerAdapter:
    """Wrap `model` in the first registered adapter that accepts it; an adapter is
    returned as it is."""
    if isinstance(model, TrainerAdapter):
        return model
    registered = trainer_adapters()
    for cls in registered:
        if not (isinstance(cls, type) and issubclass(cls, TrainerAdapter)):
            raise PluginError(f"registered trainer adapter {cls!r} does not subclass "
                              "enginehooks.trainer_side.TrainerAdapter")
        if cls.accepts(model):
            return cls(model, **kwargs)
    raise PluginError(f"no trainer adapter accepts a {type(model).__name__}; installed: "
                      f"{[c.name for c in registered]}")
