"""Fixtures the trainer-side tests share."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama checkpoint on disk (the FSDP2 rank scripts load it)."""
    from enginehooks_testkit.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("llama") / "llama", arch="llama", seed=0)
