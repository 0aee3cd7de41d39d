"""What a push returns: enough to log, to alert on, and to compare runs.

Plain data, in `core/` because every layer names it: the hooks and metrics plugins
read it, errors carry it (`error.report`), and the control plane fills it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class ReplicaResult:
    name: str
    ok: bool = False
    seconds: float = 0.0
    error: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    #: calls the push made to this replica (contract verbs and engine controls): 1 for
    #: a push on a prepared layout (`core/layout.py`)
    rpcs: int = 0


@dataclass
class PushReport:
    version: int | str
    transport: str
    bytes: int = 0
    buckets: int = 0
    tensors: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    replicas: list[ReplicaResult] = field(default_factory=list)
    error: str | None = None
    #: the class name of the error that ended the push (`ManifestError`, `PushTimeout`,
    #: ...): what metrics count failures by
    error_kind: str | None = None
    #: how the push was planned: "planned" (the full path: plan, info, check),
    #: "prepared" (one call per replica on a layout established earlier), or
    #: "fallback: <why>" (a prepared push that found the layout gone, then the full path)
    layout: str = "planned"
    #: the sender's own transport stats of the transfer (`SendStats.extra`: its
    #: `phases_ms`, several senders' parts), for profiles of the trainer side
    sender: dict[str, Any] = field(default_factory=dict)

    @property
    def rpcs(self) -> int:
        """The most calls any one replica got in this push."""
        return max((r.rpcs for r in self.replicas), default=0)

    @property
    def ok(self) -> bool:
        return self.error is None and all(r.ok for r in self.replicas)

    @property
    def seconds(self) -> float:
        return sum(self.phases.values())

    @property
    def gbps(self) -> float:
        """Payload bytes over the transfer phase, in GB/s (1e9 bytes)."""
        t = self.phases.get("transfer", 0.0)
        return self.bytes / t / 1e9 if t > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(ok=self.ok, seconds=self.seconds, gbps=self.gbps, rpcs=self.rpcs)
        return d

    def table(self) -> str:
        lines = [
            f"push v{self.version} over {self.transport}: {self.tensors} tensors, "
            f"{self.bytes / 1e6:.2f} MB in {self.buckets} buckets, "
            f"{self.seconds:.3f} s, {self.gbps:.3f} GB/s in transfer"
            + ("" if self.error is None else f"  FAILED: {self.error}"),
            f"  {'phase':<10} {'seconds':>9}",
        ]
        lines += [f"  {k:<10} {v:>9.4f}" for k, v in self.phases.items()]
        lines.append(f"  {'replica':<28} {'ok':<4} {'seconds':>9}")
        for r in self.replicas:
            lines.append(
                f"  {r.name:<28} {'yes' if r.ok else 'no':<4} {r.seconds:>9.4f}"
                + (f"  {r.error}" if r.error else "")
            )
        return "\n".join(lines)

    __str__ = table
