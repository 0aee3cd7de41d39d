"""The pluggy markers, in a leaf module that imports nothing of enginehooks.

Plugins (built-in ones included) import `hookimpl` from here or from the package root;
`hookspecs.py` imports `hookspec`. Keeping them apart from the plugin manager is what
lets built-in plugins be listed by module name without an import cycle.
"""

from __future__ import annotations

import pluggy

PROJECT = "enginehooks"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
