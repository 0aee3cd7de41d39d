"""vLLM's own RL flows with an fp32 trainer and a bf16 engine split over two
tensor-parallel workers on CPU (`VLLM_CPU_OMP_THREADS_BIND="0|1"`: one core each).

- HTTP: a vLLM server, driven the way vLLM's `examples/rl/rlhf_http_nccl.py` drives it
  (`/pause`, the trainer side of vLLM's weight-transfer API through its HTTP client with
  backend "enginehooks", `/resume`), only the backend and CPU settings changed.
- In-process: an `LLM` pushed through vLLM's weight-transfer API as `rlhf_nccl.py` does
  (the Ray placement of that example is covered by `test_ray.py`; here the point is two
  workers that each hold half of every sharded tensor).

The oracle is exact: greedy tokens and logprobs after the push equal those of the same
engine (bf16, TP=2) freshly loaded from `save_pretrained` of the pushed fp32 weights.
Every worker receives the whole update and keeps its shard: the loader decides, per
rank, what lands where (and casts fp32 to bf16), and the first update is verified on
each rank against its own fresh-load shadow.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enginehooks.control._http import request_json
from enginehooks.vllm_ext import VLLMServer
from enginehooks_testkit.engines import fresh_generate, processor_files, save_pushed
from enginehooks_testkit.generation import Generation, first_difference
from enginehooks_testkit.tiny import load_tiny, perturb
from tests.support import requires_vllm

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]

TP = 2
#: The two flows share the engine side (the backend's receiver on each TP worker, the
#: loader's cast and split, verification on each rank) and differ in the trainer's
#: driver. Each costs about a minute of a 2-core CI, so CI runs one a day, the two
#: taking turns (`todays_flows`); `ENGINEHOOKS_TP2_FLOWS=all` runs both.
FLOWS = ("http", "llm")


def todays_flows(day: int) -> set[str]:
    if os.environ.get("ENGINEHOOKS_TP2_FLOWS") == "all":
        return set(FLOWS)
    return {FLOWS[day % len(FLOWS)]}


def run_today(flow: str) -> None:
    import datetime

    if flow not in todays_flows(datetime.date.today().toordinal()):
        pytest.skip(f"the {flow} flow takes its turn tomorrow (ENGINEHOOKS_TP2_FLOWS=all "
                    "runs both)")


def test_the_flows_take_turns_and_every_flow_runs_within_two_days(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENGINEHOOKS_TP2_FLOWS", raising=False)
    days = [todays_flows(d) for d in range(100, 100 + len(FLOWS))]
    assert all(len(d) == 1 for d in days) and set().union(*days) == set(FLOWS)
    monkeypatch.setenv("ENGINEHOOKS_TP2_FLOWS", "all")
    assert todays_flows(100) == set(FLOWS)


def tp_env() -> dict[str, str]:
    env = dict(os.environ)
    # one core per worker; on a machine with more cores, the first two
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    return env


def serve(model_dir: Path, log: Path) -> Any:
    from tests.vllm.conftest import VLLMServerProcess

    return VLLMServerProcess(model_dir, log, dtype="bfloat16", env=tp_env(), extra_args=[
        "--tensor-parallel-size", str(TP),
        "--weight-transfer-config", '{"backend": "enginehooks"}'])


@pytest.fixture(scope="module")
def tp2_server(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[Any]:
    run_today("http")  # before the server starts (only the HTTP flow uses it)
    log = tmp_path_factory.mktemp("logs") / "vllm-tp2.log"
    with serve(model_dirs["llama"], log) as srv:
        yield srv


def push_over_http(url: str, model: Any, version: str) -> Any:
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    from enginehooks.vllm_ext.transfer_trainer import EnginehooksTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        EnginehooksTrainerInitInfo(rank=0, world_size=1 + TP, timeout_s=120,
                                   bucket_bytes=32 << 10),
        client=HTTPVLLMWeightSyncClient(url, timeout=120), source=ModuleSource(model))
    try:
        return engine.send_weights(weight_version=version)
    finally:
        engine.shutdown()


def test_http_flow_fp32_trainer_into_bf16_tp2_server_equals_fresh_load(
        tp2_server: Any, model_dirs: dict[str, Path], tmp_path: Path) -> None:
    url = tp2_server.url
    model = perturb(load_tiny(model_dirs["llama"]), seed=211)
    before: list[Generation] = tp2_server.generations()
    request_json(f"{url}/pause", {}, timeout_s=60)
    try:
        report = push_over_http(url, model, "tp2-1")
    finally:
        request_json(f"{url}/resume", {}, timeout_s=60)
    assert report.ok and report.buckets > 1
    got = tp2_server.generations()
    assert first_difference(got, before) is not None, "the push did not change generation"
    assert {g.version for g in got} == {"tp2-1"}
    # both workers hold the new version, verified against their own fresh-load shadow
    infos = VLLMServer(url).info(60)
    assert len(infos) == TP
    for info in infos:
        assert info["version"] == "tp2-1" and info["state"] == "current"
        assert info["verification"]["last"]["ok"] is True
        assert info["verification"]["last"]["mismatched"] == []
    # fp32 on disk: vLLM's loader casts it to bf16
    folder = save_pushed(model, model_dirs["llama"], tmp_path / "fresh")
    with serve(folder, tmp_path / "fresh.log") as fresh:
        want = fresh.generations()
    diff = first_difference(got, want)
    assert diff is None, f"bf16 TP=2 vLLM after an fp32 push != the same freshly loaded: {diff}"


def test_llm_flow_fp32_trainer_into_bf16_tp2_llm_equals_fresh_load(
        model_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json
    import subprocess
    import sys

    run_today("llm")

    folder = tmp_path / "fresh"
    request = json.dumps({"model_dir": str(model_dirs["llama"]), "seed": 212, "tp": TP,
                          "out": str(folder)})
    run = subprocess.run([sys.executable, "-m", "tests.vllm.rl_llm_child"], input=request,
                         capture_output=True, text=True, timeout=600, env=tp_env())
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"the LLM child gave no answer (rc {run.returncode}): {run.stderr[-3000:]}"
    reply = json.loads(lines[-1])
    assert reply["ok"] and reply["buckets"] > 1

    def gens(items: list[dict[str, Any]]) -> list[Generation]:
        return [Generation(tuple(g["tokens"]), tuple(g["logprobs"]), None) for g in items]

    got = gens(reply["after"])
    assert first_difference(got, gens(reply["before"])) is not None, "the push changed nothing"
    assert len(reply["infos"]) == TP
    for info in reply["infos"]:
        assert info["version"] == "llm-tp2" and info["state"] == "current"
        assert info["verification"]["last"]["ok"] is True
    checkpoint_dir = folder  # the child's save_pretrained, with the checkpoint's tokenizer
    processor_files(model_dirs["llama"], folder)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", tp_env()["VLLM_CPU_OMP_THREADS_BIND"])
    want = fresh_generate("vllm", checkpoint_dir, dtype="bfloat16",
                          engine_args={"tensor_parallel_size": TP}, timeout_s=600)
    diff = first_difference(got, want)
    assert diff is None, f"bf16 TP=2 LLM after an fp32 push != the same freshly loaded: {diff}"

