"""verl: the checkpoint-engine backend "enginehooks" (`checkpoint_engine.py`).

verl imports every `verl.plugins` entry point in each of its processes (`import verl`),
so an installed enginehooks registers the backend there and a verl user selects it with
one config value, `actor_rollout_ref.rollout.checkpoint_engine.backend=enginehooks`.
`register` imports verl only when called: importing this package needs no verl.
"""

from __future__ import annotations


def register() -> None:
    """Add "enginehooks" to verl's `CheckpointEngineRegistry` (idempotent)."""
    from enginehooks.verl_ext import checkpoint_engine  # noqa: F401 - registers on import


__all__ = ["register"]
