"""`vllm_ext/cpu_amx.allow_amx`: the AMX permission vLLM's CPU kernels need and do not ask
for (docs/engine-bugs.md). On an AMX host the request must be granted; a bf16 vLLM server
then serves (tests/vllm/test_quickstart.py fails on such a host without it). Elsewhere the
call must be a harmless False."""

from __future__ import annotations

from pathlib import Path

import pytest

from enginehooks.vllm_ext.cpu_amx import allow_amx


def _cpu_has_amx() -> bool:
    try:
        return " amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def test_allow_amx_is_granted_exactly_where_the_cpu_has_amx() -> None:
    assert allow_amx() is _cpu_has_amx()
    assert allow_amx() is _cpu_has_amx()  # asking twice is fine


def test_allow_amx_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    def refuse() -> bool:
        raise RuntimeError("arch_prctl refused")

    monkeypatch.setattr(torch._C._cpu, "_init_amx", refuse, raising=False)
    assert allow_amx() is False
