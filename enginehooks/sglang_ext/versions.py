"""Which weights produced an SGLang answer, in one label.

SGLang stamps each answer's `meta_info` with `weight_version` (the version when it
finished) and `weight_versions`, the spans of output tokens each version produced. With
the pause modes that keep requests across an update ("retract", "in_place"), an answer
can start under one version and finish under the next: its last version alone would
claim weights that did not produce its first tokens (the soak found such answers). The
label here says `mixed:<first>-><last>` then, like the vLLM front end's header, so an RL
loop can drop those rollouts; `torn:<v>` answers (policy "serve") pass through as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def answer_version(meta_info: Mapping[str, Any]) -> str | None:
    """The weight version of one answer, or `mixed:a->b` when several produced it."""
    spans = meta_info.get("weight_versions") or []
    versions = list(dict.fromkeys(str(s["version"]) for s in spans if isinstance(s, Mapping)))
    if len(versions) > 1:
        return f"mixed:{versions[0]}->{versions[-1]}"
    version = meta_info.get("weight_version")
    return None if version is None else str(version)
