"""One `WeightSync.push` updates a vLLM replica and an SGLang replica together.

vLLM and SGLang pin different torch builds, so the vLLM replica is a real vLLM server
process started from the vLLM environment; the trainer (this process) and the SGLang
server run SGLang's torch. Both engines receive the same gloo broadcast."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from enginehooks import WeightSync
from enginehooks.sglang_ext import SGLangServer
from enginehooks.vllm_ext import VLLMServer
from enginehooks_testkit.tiny import load_tiny as load_hf
from enginehooks_testkit.tiny import perturb
from tests.sglang.helpers import (
    VLLM_PYTHON,
    SGLangServerProcess,
    VLLMServerProcess,
    hf_reference,
)


@pytest.fixture(scope="module")
def vllm_server(model_dirs: dict[str, Path], logs_dir: Path) -> Iterator[VLLMServerProcess]:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"the vLLM environment is not built ({VLLM_PYTHON} missing): "
                    "run scripts/setup-vllm-env.sh")
    with VLLMServerProcess(model_dirs["llama"], logs_dir / "vllm-server.log") as srv:
        yield srv


def test_one_push_updates_vllm_and_sglang(vllm_server: VLLMServerProcess,
                                          sglang_server: SGLangServerProcess,
                                          model_dirs: dict[str, Path]) -> None:
    model = perturb(load_hf(model_dirs["llama"]), seed=71)
    want = hf_reference(model)
    vllm = VLLMServer(vllm_server.url, name="vllm")
    sgl = SGLangServer(sglang_server.url, name="sglang")
    with WeightSync("gloo", bucket_bytes=32 << 10, timeout_s=90) as sync:
        sync.add_replica(vllm)
        sync.add_replica(sgl)
        report = sync.push(model, version=5)
        assert report.ok and [r.name for r in report.replicas] == ["vllm", "sglang"]
        assert all(r.ok for r in report.replicas)
        assert vllm_server.greedy() == want
        tokens, versions = sglang_server.greedy()
        assert tokens == want and versions == {"5"}
        assert vllm.version() == 5 and sgl.version() == 5
        # A second push reuses the group across both engines.
        report = sync.push(perturb(model, seed=72), version=6)
    want = hf_reference(model)
    assert vllm_server.greedy() == want
    assert sglang_server.greedy() == (want, {"6"})
