"""Setup mistakes on a real vLLM server surface with their fix (issue 19), not as a
bare HTTP 404 or a push that waits out its timeout: one server started the way a new
user might, without `VLLM_SERVER_DEV_MODE=1` (vLLM then registers none of its control
routes) and without `--worker-extension-cls`.

(A server with dev mode but no worker extension answers every enginehooks call with
vLLM's `'CPUWorker' object has no attribute 'enginehooks_...'`; that answer, from a real
server, is checked in `tests/vllm/security/test_server_open.py` without a third server start.)"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enginehooks import WeightSync
from enginehooks.core.auth import SECRET_ENV
from enginehooks.core.errors import ConfigError
from enginehooks_testkit.tiny import load_tiny, perturb
from tests.support import have, requires_vllm

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]

if have("vllm"):  # backend "enginehooks" of vLLM's weight-transfer routes
    from tests.support.entry_points import expose_entry_points

    expose_entry_points("vllm.general_plugins")


@pytest.fixture(scope="module")
def plain_server(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[Any]:
    from enginehooks_testkit.servers import EngineServerProcess, free_port

    env = {k: v for k, v in os.environ.items()
           if k not in (SECRET_ENV, "ENGINEHOOKS_SECRET_FILE", "VLLM_SERVER_DEV_MODE")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_PLUGINS="enginehooks")
    port = free_port()
    log = tmp_path_factory.mktemp("logs") / "vllm-plain.log"
    with EngineServerProcess(
            [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry",
             "--model", str(model_dirs["llama"]), "--host", "127.0.0.1", "--port", str(port),
             "--dtype", "float32", "--max-model-len", "256", "--enforce-eager",
             "--weight-transfer-config", '{"backend": "enginehooks"}'],
            env, log, f"http://127.0.0.1:{port}") as srv:
        yield srv


def test_weightsync_names_dev_mode_and_the_worker_extension(
        plain_server: Any, model_dirs: dict[str, Path]) -> None:
    from enginehooks.vllm_ext import VLLMServer

    t0 = time.monotonic()
    with WeightSync("gloo", timeout_s=60) as sync:
        sync.add_replica(VLLMServer(plain_server.url, name="plain"))
        with pytest.raises(ConfigError, match=r"plain.*VLLM_SERVER_DEV_MODE=1.*"
                                              r"--worker-extension-cls enginehooks"):
            sync.push(perturb(load_tiny(model_dirs["llama"]), seed=80), version=1)
    assert time.monotonic() - t0 < 20  # the push's timeout_s is 60


@pytest.mark.parametrize("client", ["enginehooks", "vllm"])
def test_vllms_own_api_names_dev_mode(plain_server: Any, model_dirs: dict[str, Path],
                                      client: str) -> None:
    """Through vLLM's trainer-side API, with our handle or vLLM's own HTTP client as the
    client: the weight-transfer routes are missing too, and the error says why."""
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    from enginehooks.vllm_ext import VLLMServer
    from enginehooks.vllm_ext.transfer_trainer import EnginehooksTrainerInitInfo

    c = (VLLMServer(plain_server.url, name="plain") if client == "enginehooks"
         else HTTPVLLMWeightSyncClient(plain_server.url, timeout=60))
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"no .*route.*VLLM_SERVER_DEV_MODE=1"):
        WeightTransferTrainerFactory.trainer_init(
            EnginehooksTrainerInitInfo(rank=0, world_size=2, timeout_s=60),
            client=c, source=ModuleSource(perturb(load_tiny(model_dirs["llama"]), seed=81)))
    assert time.monotonic() - t0 < 20
