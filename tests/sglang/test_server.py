"""Pushes into a real SGLang HTTP server (`python -m sglang.launch_server`) on loopback,
through the plugin's `/enginehooks/rpc` route: correctness against HF, refusal of bad
manifests, and an unresponsive server failing the push within its timeout."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from enginehooks import ManifestError, PushTimeout, ReplicaError, WeightSync
from enginehooks.sglang_ext import SGLangServer
from enginehooks.testing.tiny import load_tiny as load_hf
from enginehooks.testing.tiny import perturb
from enginehooks.trainer_side import StateDictAdapter, adapter_for
from tests.sglang.helpers import SGLangServerProcess, hf_reference


def assert_server_matches(srv: SGLangServerProcess, handle: SGLangServer, model: Any,
                          version: Any) -> None:
    tokens, versions = srv.greedy()
    assert tokens == hf_reference(model)
    assert versions == {str(version)}
    assert handle.version() == version


@pytest.mark.parametrize("transport", ["gloo", "disk"])
def test_push_into_server_matches_hf(sglang_server: SGLangServerProcess,
                                     model_dirs: dict[str, Path], tmp_path: Path,
                                     transport: str) -> None:
    model = perturb(load_hf(model_dirs["llama"]), seed=61 if transport == "gloo" else 62)
    before, _ = sglang_server.greedy()
    handle = SGLangServer(sglang_server.url, name="sglang-server")
    opts = {"root": tmp_path / "ckpt"} if transport == "disk" else {}
    with WeightSync(transport, bucket_bytes=32 << 10, timeout_s=60, pause=True,
                    transport_options=opts) as sync:
        sync.add_replica(handle)
        report = sync.push(model, version=f"srv-{transport}")
    assert report.ok
    assert sglang_server.greedy()[0] != before
    assert_server_matches(sglang_server, handle, model, f"srv-{transport}")


def test_bad_manifest_refused_server_keeps_serving(sglang_server: SGLangServerProcess,
                                                   model_dirs: dict[str, Path]) -> None:
    model = perturb(load_hf(model_dirs["llama"]), seed=63)
    handle = SGLangServer(sglang_server.url, name="sglang-server")
    with WeightSync("gloo", timeout_s=60) as sync:
        sync.add_replica(handle)
        sync.push(model, version="good")
        good, _ = sglang_server.greedy()
        for bad_name, bad in [("model.layers.0.mlp.not_a_weight", torch.zeros(4)),
                              ("model.layers.1.self_attn.k_proj.weight", torch.zeros(3, 64))]:
            sd = dict(adapter_for(model).stream())  # the checkpoint format
            sd[bad_name] = bad
            adapter = StateDictAdapter(sd)
            with pytest.raises(ManifestError, match=bad_name.replace(".", r"\.")):
                sync.push(adapter, version="bad")
            assert adapter.produced == 0, "data moved before the manifest was validated"
    tokens, versions = sglang_server.greedy()
    assert tokens == good and versions == {"good"}
    assert handle.version() == "good"


def test_stopped_server_fails_push_within_timeout(sglang_server: SGLangServerProcess,
                                                  model_dirs: dict[str, Path]) -> None:
    """SIGSTOP the whole server (HTTP process and scheduler): the push must fail within
    its timeout with an error naming the replica, and nothing may hang. After SIGCONT
    the server serves again and a push succeeds."""
    model = perturb(load_hf(model_dirs["llama"]), seed=64)
    handle = SGLangServer(sglang_server.url, name="sglang-stopped")
    sync = WeightSync("gloo", timeout_s=4, dtype="float32")
    sync.add_replica(handle)
    sglang_server.signal_group(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises((PushTimeout, ReplicaError)) as err:
            sync.push(model, version="never")
        took = time.monotonic() - t0
    finally:
        sglang_server.signal_group(signal.SIGCONT)
    assert took < 30, f"push took {took:.1f}s to fail"
    assert "sglang-stopped" in str(err.value) or "did not answer" in str(err.value)
    sync.timeout_s = 60
    report = sync.push(model, version="after-stop")
    sync.close()
    assert report.ok
    assert_server_matches(sglang_server, handle, model, "after-stop")


def test_push_under_traffic_with_pause(sglang_server: SGLangServerProcess,
                                       model_dirs: dict[str, Path]) -> None:
    """Requests in flight while a push runs: generation is paused (retract mode) around
    the update, so the in-scheduler cache flush succeeds, every request completes, and
    generation afterwards is exactly HF's on the new weights."""
    from concurrent.futures import ThreadPoolExecutor

    from enginehooks.control._http import request_json

    model = perturb(load_hf(model_dirs["llama"]), seed=65)
    handle = SGLangServer(sglang_server.url, name="sglang-busy", pause_mode="retract")
    long = {"temperature": 0.0, "max_new_tokens": 300, "ignore_eos": True}

    def generate(prompt: list[int]) -> dict[str, Any]:
        return request_json(f"{sglang_server.url}/generate",
                            {"input_ids": prompt, "sampling_params": long}, timeout_s=120)

    with ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(generate, p) for p in ([7, 8, 9], [30, 31])]
        time.sleep(0.5)  # let the requests start decoding before the push
        with WeightSync("gloo", timeout_s=60, pause=True) as sync:
            sync.add_replica(handle)
            report = sync.push(model, version="busy-1")
        outs = [f.result(timeout=120) for f in futs]
    assert report.ok
    assert all(len(o["output_ids"]) == 300 for o in outs)
    assert handle._last_flushed is True
    assert_server_matches(sglang_server, handle, model, "busy-1")


def test_server_with_api_key(model_dirs: dict[str, Path], logs_dir: Path) -> None:
    """A server started with `--api-key`: the plugin's route is behind SGLang's own key
    check; a handle without the key is refused with a clear error (and nothing moves),
    the handle with it pushes."""
    from enginehooks.testing.servers import SGLangServerProcess as Server

    with Server(model_dirs["llama"], logs_dir / "sglang-api-key.log",
                extra_args=["--api-key", "test-key-123"]) as srv:
        model = perturb(load_hf(model_dirs["llama"]), seed=91)
        with WeightSync("gloo", timeout_s=60) as sync:
            sync.add_replica(SGLangServer(srv.url, name="keyless"))
            with pytest.raises(ReplicaError, match=r"keyless.*HTTP 401"):
                sync.push(model, version=1)
        keyed = SGLangServer(srv.url, name="keyed", api_key="test-key-123")
        with WeightSync("gloo", timeout_s=60) as sync:
            sync.add_replica(keyed)
            sync.push(model, version=2)
        sp = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
        out = [keyed.generate(p, sp) for p in ([5, 6, 7, 8], [10, 11, 12])]
        assert [o["output_ids"] for o in out] == hf_reference(model)[:2]
        assert {o["meta_info"]["weight_version"] for o in out} == {"2"}
        assert keyed.version() == 2
