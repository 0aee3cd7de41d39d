"""The one plugin manager, and the registries it fills.

Built-in plugins are listed by module name in `DEFAULT_PLUGINS` and registered exactly
like third-party ones; then entry points of the `enginehooks` group are loaded. Engines
import plugins in every worker process, sometimes more than once, so everything here
is created once per process, under a lock, and loading again is a no-op.

This module imports no plugin at import time (they are imported by name when the
manager is first built), which keeps the plugin core free of import cycles.
"""

from __future__ import annotations

import importlib
import threading
from typing import TYPE_CHECKING, Any

import pluggy

from enginehooks import hookspecs
from enginehooks.core.errors import PluginError
from enginehooks.markers import PROJECT

if TYPE_CHECKING:
    from enginehooks.trainer_side.contract import TrainerAdapter
    from enginehooks.transports.base import Transport

ENTRY_POINT_GROUP = PROJECT

#: Built-in plugins, registered in this order before entry points are loaded.
DEFAULT_PLUGINS: tuple[str, ...] = (
    "enginehooks.defaults",
    "enginehooks.transports.plugin",
    "enginehooks.trainer_side.plugin",
)

_lock = threading.RLock()
_pm: pluggy.PluginManager | None = None
_transports: dict[str, type[Transport]] | None = None
_adapters: list[type[TrainerAdapter]] | None = None


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide manager: built-ins plus entry points, loaded once."""
    global _pm
    with _lock:
        if _pm is None:
            pm = pluggy.PluginManager(PROJECT)
            pm.add_hookspecs(hookspecs)
            for module_name in DEFAULT_PLUGINS:
                pm.register(importlib.import_module(module_name), name=module_name)
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


def transports() -> dict[str, type[Transport]]:
    """Name -> transport class, as registered by every plugin."""
    global _transports
    with _lock:
        if _transports is None:
            found: dict[str, type[Transport]] = {}
            owners: dict[str, str] = {}

            def register(cls: type[Transport]) -> None:
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


def get_transport(name: str) -> Transport:
    """An instance of the transport registered as `name`."""
    known = transports()
    if name not in known:
        raise PluginError(f"no transport named {name!r}; installed: {sorted(known)}")
    return known[name]()


def trainer_adapters() -> list[type[TrainerAdapter]]:
    """Adapter classes, most recently registered plugin first (so plugins can override
    the built-in adapters for their own model types). Selection of the adapter for a
    model is `enginehooks.trainer_side.adapter_for`."""
    global _adapters
    with _lock:
        if _adapters is None:
            found: list[type[TrainerAdapter]] = []
            # pluggy calls the most recently registered implementation first.
            get_plugin_manager().hook.register_trainer_adapters(register=found.append)
            _adapters = found
        return list(_adapters)
