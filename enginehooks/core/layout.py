"""Plan once, push many (issue 37): a prepared layout, and the reference that names it.

The first push to a set of replicas plans the update (the adapter's specs, the
manifest), asks each replica's workers for their facts (`info`) and their verdict
(`check`), and moves the bytes with the whole manifest. Nothing of that depends on the
weights' values: it depends on the model's names, dtypes and shapes (after the
checkpoint conversion), on the push options (bucket size, checksum, transport), and on
which workers receive. A worker keeps every manifest it checked and took, by the
layout id the trainer wrote into it (`meta["layout"]`); the trainer keeps the plan
under the same id and a key of everything the plan depends on. A later push whose key
is the same sends each replica one signed `receive` whose manifest argument is only
`{"layout": id, "weight_version": v}` (`reference`); the worker rebuilds the manifest
from the one it checked (`with_version`), so it refuses exactly what it refused
before (it took this one), and every bucket is still digested and keyed under the
rebuilt manifest's id. A worker that does not hold the layout (restarted since)
answers `LayoutUnknown` before anything changes, and the trainer falls back to the
full path; a key that differs (another tensor, another dtype, another replica set)
never takes the prepared path at all.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable
from typing import Any

from enginehooks.core.errors import ManifestError
from enginehooks.core.manifest import MID_MEMO, Manifest

#: the manifest's `meta` key holding its layout id
LAYOUT_KEY = "layout"
#: the longest reference a worker parses (a layout id is 32 hex digits)
MAX_REFERENCE_CHARS = 1024


def layout_key(parts: Iterable[Any]) -> str:
    """A digest of what a plan depends on (JSON-able parts, in order)."""
    text = json.dumps(list(parts), separators=(",", ":"), sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def reference(layout: str, version: int | str) -> str:
    """The `receive` argument of a push on prepared layout `layout`."""
    return json.dumps({LAYOUT_KEY: layout, "weight_version": version}, separators=(",", ":"))


def parse_reference(text: Any) -> tuple[str, int | str] | None:
    """(layout id, weight version) if `text` is a reference, None if it is something
    else (a whole manifest); `ManifestError` for a malformed reference."""
    if not isinstance(text, (str, bytes)) or len(text) > MAX_REFERENCE_CHARS:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or LAYOUT_KEY not in data or "tensors" in data:
        return None
    layout, version = data.get(LAYOUT_KEY), data.get("weight_version")
    if not isinstance(layout, str) or not layout or len(layout) > 128:
        raise ManifestError(f"a layout reference names its layout by a short string, not "
                            f"{layout!r:.80}")
    if not isinstance(version, (int, str)) or isinstance(version, bool):
        raise ManifestError(f"weight_version must be an int or a str, got {version!r:.80}")
    return layout, version


def layout_of(manifest: Manifest) -> str | None:
    """The layout id a manifest was planned under, if any."""
    value = manifest.meta.get(LAYOUT_KEY)
    return value if isinstance(value, str) and value else None


def with_version(manifest: Manifest, version: int | str) -> Manifest:
    """`manifest` for another weight version: everything else, the layout id included,
    unchanged (its manifest id, which keys every bucket, changes with the version).
    The memos derived from the layout (`core/manifest.MID_MEMO`'s comment) come along,
    so a prepared push serialises and indexes nothing of its manifest again."""
    out = dataclasses.replace(manifest, weight_version=version)
    memo = {k: v for k, v in manifest.__dict__.items()
            if k.startswith("_enginehooks_") and k != MID_MEMO}
    out.__dict__.update(memo)
    return out
