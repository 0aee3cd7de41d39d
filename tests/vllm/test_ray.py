"""Engines in Ray actors, on a local Ray cluster (2 CPUs, no dashboard): a trainer actor
holds the `WeightSync` and pushes over gloo into a `vllm.LLM` in another actor (the
verl / OpenRLHF layout), a killed engine actor fails the push naming it within the
timeout, and an `sglang.Engine` actor runs SGLang's own interpreter through Ray's
`runtime_env={"py_executable": ...}` (one engine alive at a time: 2-core machines).

Correctness: the engine's greedy tokens after the push equal HF transformers' on the
trainer's new weights, and the crc32 digests of the weights the engine keeps in
checkpoint layout equal the trainer's tensors.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from enginehooks_testkit.engines import NEW_TOKENS, PROMPTS, SGLANG_ENGINE_ARGS
from enginehooks_testkit.tiny import hf_greedy, load_tiny, perturb
from tests.support import requires_vllm

ray = pytest.importorskip("ray", reason="Ray is not installed in this environment")

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
READABLE = ["model.embed_tokens.weight", "model.norm.weight"]
GREEDY_VLLM = {"temperature": 0.0, "max_tokens": NEW_TOKENS, "ignore_eos": True}
GREEDY_SGLANG = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
SGLANG_PYTHON = os.environ.get(
    "ENGINEHOOKS_SGLANG_PYTHON", str(Path.home() / ".cache/enginehooks/venv-sglang/bin/python"))


def actor_env(**extra: str) -> dict[str, str]:
    """Environment of every actor: this checkout importable, offline, small CPU engines."""
    path = [str(ROOT), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(path)), "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "1", **extra}


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 << 20,
             runtime_env={"env_vars": actor_env()}, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


class Trainer:
    """The trainer actor: owns the model and the `WeightSync`; engines are actor handles
    passed in, reached through `RayEngine`. Returns only JSON-able data."""

    def __init__(self, model_dir: str, engines: dict[str, Any], timeout_s: float) -> None:
        from enginehooks import WeightSync
        from enginehooks.ray_ext import RayEngine
        from enginehooks_testkit.tiny import load_tiny

        self.model = load_tiny(model_dir)
        self.sync = WeightSync("gloo", timeout_s=timeout_s, bucket_bytes=32 << 10)
        self.handles = {name: RayEngine(actor, name=name) for name, actor in engines.items()}
        for handle in self.handles.values():
            self.sync.add_replica(handle)

    def train_and_push(self, seed: int, version: int, kill_at_transfer: str | None = None
                       ) -> dict[str, Any]:
        from enginehooks import EngineHooksError, hookimpl
        from enginehooks.plugins import register_plugin, unregister_plugin
        from enginehooks_testkit.tiny import perturb

        perturb(self.model, seed=seed)

        class KillAtTransfer:  # the engine actor dies as the data starts moving
            @hookimpl(wrapper=True)
            def run_phase(self, phase: str, report: Any, run: Any) -> Any:
                if phase == "transfer":
                    ray.kill(ray.get_actor(kill_at_transfer))
                return (yield)

        killer = KillAtTransfer() if kill_at_transfer else None
        if killer is not None:
            register_plugin(killer, name="kill-at-transfer")
        t0 = time.monotonic()
        try:
            report = self.sync.push(self.model, version=version)
            return {"ok": True, "report": report.to_dict(), "seconds": time.monotonic() - t0}
        except EngineHooksError as e:
            return {"ok": False, "kind": type(e).__name__, "error": str(e), "replica": e.replica,
                    "seconds": time.monotonic() - t0}
        finally:
            if killer is not None:
                unregister_plugin(killer)

    def crc32(self, names: list[str]) -> dict[str, int]:
        from enginehooks.trainer_side import adapter_for

        sent = dict(adapter_for(self.model).stream())
        return {n: zlib.crc32(sent[n].reshape(-1).view(torch.uint8).numpy()) for n in names}

    def engine_digests(self, name: str, names: list[str]) -> dict[str, int]:
        return {n: d["crc32"] for n, d in self.handles[name].digests(names).items()}

    def engine_version(self, name: str) -> Any:
        return self.handles[name].version()


def start_trainer(model_dir: Path, engines: dict[str, Any], timeout_s: float) -> Any:
    return ray.remote(num_cpus=1)(Trainer).remote(str(model_dir), engines, timeout_s)


@pytest.fixture(scope="module")
def vllm_actor(cluster: None, model_dirs: dict[str, Path]) -> Iterator[Any]:
    from enginehooks.ray_ext import VLLMActor

    actor = ray.remote(num_cpus=1)(VLLMActor).options(
        name="rollout-0",
        runtime_env={"env_vars": actor_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")},
    ).remote(str(model_dirs["llama"]), name="rollout-0", dtype="float32", max_model_len=256,
             enforce_eager=True, seed=0, enable_prefix_caching=True)
    ray.get(actor.weight_version.remote(), timeout=300)  # started
    yield actor
    with contextlib.suppress(Exception):
        ray.kill(actor)


def test_trainer_actor_pushes_into_vllm_actor_over_gloo(vllm_actor: Any,
                                                        model_dirs: dict[str, Path]) -> None:
    trainer = start_trainer(model_dirs["llama"], {"rollout-0": vllm_actor}, timeout_s=60)
    before = ray.get(vllm_actor.generate.remote(PROMPTS, GREEDY_VLLM), timeout=120)
    out = ray.get(trainer.train_and_push.remote(seed=91, version=1), timeout=300)
    assert out["ok"], out
    assert out["report"]["buckets"] > 1 and out["report"]["replicas"][0]["name"] == "rollout-0"
    after = ray.get(vllm_actor.generate.remote(PROMPTS, GREEDY_VLLM), timeout=120)
    assert after != before
    model = perturb(load_tiny(model_dirs["llama"]), seed=91)  # the trainer's weights, here
    assert [o["token_ids"] for o in after] == hf_greedy(model, PROMPTS, NEW_TOKENS)
    assert ray.get(trainer.engine_version.remote("rollout-0"), timeout=60) == 1
    assert ray.get(vllm_actor.weight_version.remote(), timeout=60) == "1"  # vLLM's own
    assert (ray.get(trainer.engine_digests.remote("rollout-0", READABLE), timeout=60)
            == ray.get(trainer.crc32.remote(READABLE), timeout=60))
    ray.kill(trainer)


def test_killed_engine_actor_fails_the_push_naming_it(vllm_actor: Any,
                                                      model_dirs: dict[str, Path]) -> None:
    timeout_s = 30.0
    trainer = start_trainer(model_dirs["llama"], {"rollout-0": vllm_actor}, timeout_s=timeout_s)
    assert ray.get(trainer.train_and_push.remote(seed=92, version=2), timeout=300)["ok"]
    t0 = time.monotonic()
    out = ray.get(trainer.train_and_push.remote(seed=93, version=3, kill_at_transfer="rollout-0"),
                  timeout=timeout_s * 3)
    elapsed = time.monotonic() - t0
    assert not out["ok"], out
    assert "rollout-0" in out["error"] and out["replica"] == "rollout-0", out
    assert "dead" in out["error"] or "died" in out["error"], out
    assert out["seconds"] < timeout_s and elapsed < timeout_s + 10, out
    ray.kill(trainer)


def sglang_python_problem() -> str | None:
    """Why Ray cannot start an actor in SGLang's interpreter here, or None."""
    if not Path(SGLANG_PYTHON).exists():
        return f"no SGLang environment at {SGLANG_PYTHON} (set ENGINEHOOKS_SGLANG_PYTHON)"
    probe = subprocess.run([SGLANG_PYTHON, "-c", "import ray, sglang; print(ray.__version__)"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        return f"SGLang's interpreter cannot import ray and sglang: {probe.stderr[-500:]}"
    if probe.stdout.strip() != ray.__version__:
        return (f"SGLang's environment has ray {probe.stdout.strip()}, the cluster runs "
                f"{ray.__version__}: Ray's workers must run the cluster's version")
    return None


def test_sglang_actor_in_its_own_interpreter(cluster: None, vllm_actor: Any,
                                             model_dirs: dict[str, Path]) -> None:
    """Runs after the vLLM actor is gone (killed above), so one engine is alive."""
    problem = sglang_python_problem()
    if problem:
        pytest.skip(problem)
    from enginehooks.ray_ext import SGLangActor
    from enginehooks_testkit.servers import cpu_env

    with contextlib.suppress(Exception):
        ray.kill(vllm_actor)
    env = {k: v for k, v in cpu_env(actor_env(SGLANG_PLUGINS="enginehooks")).items()
           if k in {"PYTHONPATH", "SGLANG_USE_CPU_ENGINE", "SGLANG_PLUGINS", "HF_HUB_OFFLINE",
                    "TOKENIZERS_PARALLELISM"}}
    actor = ray.remote(num_cpus=1)(SGLangActor).options(
        name="rollout-sglang", runtime_env={"py_executable": SGLANG_PYTHON, "env_vars": env},
    ).remote(str(model_dirs["llama"]), name="rollout-sglang", dtype="float32", **SGLANG_ENGINE_ARGS)
    trainer = None
    try:
        before = ray.get(actor.generate.remote(PROMPTS, GREEDY_SGLANG), timeout=400)
        trainer = start_trainer(model_dirs["llama"], {"rollout-sglang": actor}, timeout_s=60)
        out = ray.get(trainer.train_and_push.remote(seed=94, version=5), timeout=300)
        assert out["ok"], out
        after = ray.get(actor.generate.remote(PROMPTS, GREEDY_SGLANG), timeout=120)
        assert after != before
        model = perturb(load_tiny(model_dirs["llama"]), seed=94)
        assert [o["token_ids"] for o in after] == hf_greedy(model, PROMPTS, NEW_TOKENS)
        assert {o["weight_version"] for o in after} == {"5"}  # SGLang's own stamp
        assert (ray.get(trainer.engine_digests.remote("rollout-sglang", READABLE), timeout=60)
                == ray.get(trainer.crc32.remote(READABLE), timeout=60))
    finally:
        if trainer is not None:
            ray.kill(trainer)
        with contextlib.suppress(Exception):
            ray.get(actor.shutdown.remote(), timeout=60)
        with contextlib.suppress(Exception):
            ray.kill(actor)
