"""Which modules an update leaves out whole: the manifest's `meta["keep"]`.

Shared by the trainer side (`trainer_side.keep`, which leaves them out and lists them)
and the engine side (`engine.expectations`, which checks that every module sent is
whole and keeps the rest). A module is named by its checkpoint name prefix
("model.vision_tower"); a tensor belongs to it when its name is the prefix or starts
with the prefix and a dot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from enginehooks.core.errors import ManifestError

__all__ = ["KEEP_KEY", "kept_modules", "under"]

#: The manifest's `meta` key listing the modules an update leaves out.
KEEP_KEY = "keep"


def kept_modules(meta: Mapping[str, Any]) -> tuple[str, ...]:
    """The modules a manifest's `meta` declares the update leaves out (checkpoint name
    prefixes, each a whole module)."""
    keep = meta.get(KEEP_KEY) or ()
    if isinstance(keep, str) or not isinstance(keep, (list, tuple)) or not all(
            isinstance(k, str) and k.strip(".") for k in keep):
        raise ManifestError(f"meta[{KEEP_KEY!r}] lists module names (non-empty strings), "
                            f"not {keep!r:.200}")
    return tuple(k.strip(".") for k in keep)


def under(name: str, keep: Sequence[str]) -> bool:
    """Whether checkpoint tensor `name` belongs to one of the modules in `keep`."""
    return any(name == k or name.startswith(k + ".") for k in keep)
