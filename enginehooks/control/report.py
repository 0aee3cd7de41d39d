"""`PushReport` and `ReplicaResult`, where they were first documented; they live in
`core/report.py` (every layer names them)."""

from __future__ import annotations

from enginehooks.core.report import PushReport, ReplicaResult

__all__ = ["PushReport", "ReplicaResult"]
