"""Pushes into a real vLLM HTTP server process (dev mode, loopback)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from enginehooks import ManifestError, PushTimeout, ReplicaError, TransportError, WeightSync
from enginehooks.testing.engines import NEW_TOKENS, PROMPTS
from enginehooks.testing.tiny import hf_greedy, perturb
from enginehooks.testing.tiny import load_tiny as load_hf
from enginehooks.vllm_ext import VLLMServer
from tests.support import requires_vllm

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]


def test_gloo_push_to_server_matches_hf(vllm_server: Any, model_dirs: dict[str, Path]) -> None:
    model = perturb(load_hf(model_dirs["llama"]), seed=61)
    handle = VLLMServer(vllm_server.url, name="server")
    with WeightSync("gloo", bucket_bytes=32 << 10, timeout_s=60, pause=True) as sync:
        sync.add_replica(handle)
        r1 = sync.push(model, version=1)
        assert vllm_server.greedy() == hf_greedy(model, PROMPTS, NEW_TOKENS)
        r2 = sync.push(perturb(model, seed=62), version=2)
    assert r1.ok and r2.ok and r2.buckets == r1.buckets > 1
    assert vllm_server.greedy() == hf_greedy(model, PROMPTS, NEW_TOKENS)
    assert handle.version() == 2


def test_bad_manifest_refused_by_server(vllm_server: Any, model_dirs: dict[str, Path]) -> None:
    import torch

    model = perturb(load_hf(model_dirs["llama"]), seed=63)
    handle = VLLMServer(vllm_server.url, name="server")
    with WeightSync("gloo", timeout_s=60) as sync:
        sync.add_replica(handle)
        sync.push(model, version=10)
        tokens = vllm_server.greedy()
        with torch.no_grad():
            model.lm_head.weight = torch.nn.Parameter(torch.zeros(300, 64))  # wrong vocab
        with pytest.raises(ManifestError, match=r"lm_head.weight.*shape \[300, 64\]"):
            sync.push(model, version=11)
    assert handle.version() == 10
    assert vllm_server.greedy() == tokens


def test_unresponsive_replica_fails_push_within_timeout(
    vllm_server: Any, model_dirs: dict[str, Path]
) -> None:
    """A replica that stops answering (SIGSTOP: alive, silent) must make the push fail
    within its timeout with an error naming it; after it wakes, pushes work again."""
    model = perturb(load_hf(model_dirs["llama"]), seed=64)
    handle = VLLMServer(vllm_server.url, name="frozen-server")
    timeout_s = 4.0
    with WeightSync("gloo", timeout_s=timeout_s) as sync:
        sync.add_replica(handle)
        sync.push(model, version=20)
        os.killpg(vllm_server.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises((PushTimeout, ReplicaError)) as err:
                sync.push(model, version=21)
            elapsed = time.monotonic() - t0
        finally:
            os.killpg(vllm_server.proc.pid, signal.SIGCONT)
        assert "frozen-server" in str(err.value)
        assert elapsed < 2 * timeout_s + 2, f"push took {elapsed:.1f}s to fail"
        assert err.value.report.error is not None  # type: ignore[attr-defined]
        sync.timeout_s = 60
        sync.push(perturb(model, seed=65), version=22)
    assert handle.version() == 22
    assert vllm_server.greedy() == hf_greedy(model, PROMPTS, NEW_TOKENS)


def test_replica_frozen_mid_transfer_fails_push_within_timeout(
    vllm_server: Any, model_dirs: dict[str, Path]
) -> None:
    """The server freezes just as the data starts moving: the sender must not wait on the
    collective forever; the push fails within about its timeout, and once the server
    wakes it reports a torn update and the next push repairs it."""
    from enginehooks import hookimpl
    from enginehooks.plugins import register_plugin, unregister_plugin

    model = perturb(load_hf(model_dirs["llama"]), seed=66)
    handle = VLLMServer(vllm_server.url, name="server")
    timeout_s = 5.0

    class FreezeAtTransfer:
        @hookimpl(wrapper=True)
        def run_phase(self, phase, report, run):
            if phase == "transfer":
                os.killpg(vllm_server.proc.pid, signal.SIGSTOP)
            return (yield)

    with WeightSync("gloo", timeout_s=timeout_s, bucket_bytes=4 << 10) as sync:
        sync.add_replica(handle)
        freezer = FreezeAtTransfer()
        register_plugin(freezer, name="freezer")
        try:
            t0 = time.monotonic()
            with pytest.raises((PushTimeout, ReplicaError, TransportError)):
                sync.push(model, version=30)
            elapsed = time.monotonic() - t0
        finally:
            unregister_plugin(freezer)
            os.killpg(vllm_server.proc.pid, signal.SIGCONT)
        assert elapsed < 2 * timeout_s + 8, f"push took {elapsed:.1f}s to fail"
        sync.timeout_s = 60
        sync.push(model, version=31)
    assert handle.version() == 31
    assert vllm_server.greedy() == hf_greedy(model, PROMPTS, NEW_TOKENS)
