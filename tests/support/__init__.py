"""Helpers shared by the test suites (plain functions; fixtures live in conftest.py)."""

from __future__ import annotations

import importlib.util

import pytest


def have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


requires_vllm = pytest.mark.skipif(not have("vllm"), reason="vLLM runs in its own environment "
                                   "(scripts/test.sh runs this there)")
requires_sglang = pytest.mark.skipif(not have("sglang"), reason="SGLang runs in its own "
                                     "environment (scripts/test.sh runs this there)")
