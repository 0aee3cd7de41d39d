"""The one plugin manager, and the registries it fills.

Built-in transports, adapters and timing are registered as plugins exactly like third
party ones, then entry points of the `enginehooks` group are loaded. Engines import
plugins in every worker process, sometimes more than once, so everything here is
created once per process, under a lock, and loading again is a no-op.
"""

from __future__ import annotations

import threading
from typing import Any

import pluggy

from enginehooks import hookspecs
from enginehooks.errors import PluginError

ENTRY_POINT_GROUP = "enginehooks"
hookimpl = pluggy.HookimplMarker("enginehooks")

_lock = threading.RLock()
_pm: pluggy.PluginManager | None = None
_transports: dict[str, type] | None = None
_adapters: list[type] | None = None


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide manager: built-ins plus entry points, loaded once."""
    global _pm
    with _lock:
        if _pm is None:
            from enginehooks import builtins

            pm = pluggy.PluginManager("enginehooks")
            pm.add_hookspecs(hookspecs)
            for plugin in builtins.PLUGINS:
                pm.register(plugin, name=f"enginehooks.builtin.{plugin.__name__.rsplit('.', 1)[-1]}")
            pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
            _pm = pm
        return _pm


def register_plugin(plugin: Any, name: str | None = None) -> None:
    """Register a plugin object at run time (tests, notebooks); registries refresh."""
    with _lock:
        get_plugin_manager().register(plugin, name=name)
        _reset_registries()


def unregister_plugin(plugin: Any) -> None:
    with _lock:
        get_plugin_manager().unregister(plugin)
        _reset_registries()


def _reset_registries() -> None:
    global _transports, _adapters
    _transports = None
    _adapters = None


def transports() -> dict[str, type]:
    """Name -> transport class, as registered by every plugin."""
    global _transports
    with _lock:
        if _transports is None:
            found: dict[str, type] = {}
            owners: dict[str, str] = {}

            def register(cls: type) -> None:
                name = getattr(cls, "name", None)
                if not isinstance(name, str) or not name:
                    raise PluginError(f"transport class {cls!r} has no `name`")
                if name in found and found[name] is not cls:
                    raise PluginError(
                        f"transport {name!r} registered twice: {owners[name]} and "
                        f"{cls.__module__}.{cls.__qualname__}"
                    )
                found[name] = cls
                owners[name] = f"{cls.__module__}.{cls.__qualname__}"

            get_plugin_manager().hook.register_transports(register=register)
            _transports = found
        return dict(_transports)


def get_transport(name: str) -> Any:
    """An instance of the transport registered as `name`."""
    known = transports()
    if name not in known:
        raise PluginError(f"no transport named {name!r}; installed: {sorted(known)}")
    return known[name]()


def trainer_adapters() -> list[type]:
    """Adapter classes, most recently registered plugin first (so plugins can override
    the built-in plain-module adapter for their own model types)."""
    global _adapters
    with _lock:
        if _adapters is None:
            found: list[type] = []
            # pluggy calls the most recently registered implementation first.
            get_plugin_manager().hook.register_trainer_adapters(register=found.append)
            _adapters = found
        return list(_adapters)


def adapter_for(model: Any, **kwargs: Any) -> Any:
    """Wrap `model` in the first registered adapter that accepts it."""
    if hasattr(model, "specs") and hasattr(model, "stream"):
        return model  # already an adapter
    for cls in trainer_adapters():
        if cls.accepts(model):
            return cls(model, **kwargs)
    raise PluginError(
        f"no trainer adapter accepts a {type(model).__name__}; installed: "
        f"{[c.name for c in trainer_adapters()]}"
    )
