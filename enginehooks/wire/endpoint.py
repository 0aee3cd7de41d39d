"""A transport group's endpoint, typed: what a sender answers (`Sender.endpoint()`, JSON
that travels to every worker inside a `join`) and a receiver reads back, parsed once at
the boundary. Two shapes travel today: a process group's (`host`, `port`, `group`,
`world_size`, ...: `GroupEndpoint`) and a folder's (the disk transport's `root`); either
way the group's id is what the workers record (`group_id`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from enginehooks.core.errors import TransportError


def group_id(endpoint: Mapping[str, Any] | None) -> str | None:
    """The id of the group an endpoint opens, as the workers record it: the process
    group's name, or the disk transport's folder (`root`); None when it names none."""
    if not endpoint:
        return None
    return str(endpoint.get("group") or endpoint.get("root") or "") or None


@dataclass(frozen=True)
class GroupEndpoint:
    """What a receiver reads from a group sender's endpoint (JSON from the coordinator)."""

    transport: str
    host: str
    port: int
    group: str
    timeout_s: float
    world_size: int
    connect_timeout_s: float | None = None

    @property
    def prefix(self) -> str:
        return f"enginehooks/{self.group}/"

    @classmethod
    def parse(cls, endpoint: Mapping[str, Any], rank: int) -> GroupEndpoint:
        """Validate `endpoint` for receiver `rank`; errors say which field is wrong."""
        try:
            ep = cls(
                transport=str(endpoint["transport"]), host=str(endpoint["host"]),
                port=int(endpoint["port"]), group=str(endpoint["group"]),
                timeout_s=float(endpoint["timeout_s"]), world_size=int(endpoint["world_size"]),
                connect_timeout_s=(None if endpoint.get("connect_timeout_s") is None
                                   else float(endpoint["connect_timeout_s"])),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise TransportError(f"bad group endpoint {endpoint!r}: {e!r}") from None
        if not 1 <= rank < ep.world_size:
            raise TransportError(f"rank {rank} is outside 1..{ep.world_size - 1}")
        return ep
