"""The reliability and security contract, over HTTP, for every engine's server
installed here: a real server started with a shared secret in its environment.

- a trainer killed in the middle of a push leaves the server refusing generation
  (HTTP 503, naming the failed version and why) until the next push repairs it;
- a request that arrives while an update is applied waits for it and is answered by
  the new weights (no 503 for a healthy update);
- with on_torn="serve" the server serves and marks its answers;
- unsigned, wrongly signed and replayed updates are refused and change nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enginehooks import EngineHooksError, ReplicaError, WeightSync
from enginehooks.core.auth import SECRET_ENV, canonical, sign
from enginehooks.core.manifest import TensorSpec, plan
from enginehooks.engine.beacon import Beacon
from enginehooks.engine.contract import CHECK, method_name
from enginehooks.testing.engines import NEW_TOKENS, PROMPTS, first_difference
from enginehooks.testing.servers import HANDLES, SERVERS
from enginehooks.testing.tiny import hf_greedy, load_tiny, perturb
from enginehooks.trainer_side import ModuleAdapter
from tests.support import have

SECRET = "server-contract-secret"


@pytest.fixture(scope="module", params=sorted(SERVERS))
def server(request: pytest.FixtureRequest, model_dirs: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    engine = request.param
    if not have(engine):
        pytest.skip(f"{engine} runs in its own environment (scripts/test.sh runs it there)")
    env = dict(os.environ, **{SECRET_ENV: SECRET})
    log = tmp_path_factory.mktemp("logs") / f"{engine}-secret.log"
    with SERVERS[engine](model_dirs["llama"], log, env=env) as srv:
        srv.engine = engine
        yield srv


def handle(server: Any) -> Any:
    # A vLLM server with a secret guards its control routes (/collective_rpc, ...):
    # the handle signs its calls with the secret (docs/security.md).
    options = {"secret": SECRET} if server.engine == "vllm" else {}
    return HANDLES[server.engine](server.url, name=f"{server.engine}-server", **options)


def signed_push(server: Any, model: Any, version: Any, **options: Any) -> Any:
    with WeightSync("gloo", timeout_s=60, secret=SECRET, **options) as sync:
        sync.add_replica(handle(server))
        return sync.push(model, version=version)


class BreaksMidStream(ModuleAdapter):
    def stream(self) -> Any:
        for i, item in enumerate(super().stream()):
            if i == 5:
                raise RuntimeError("trainer rank lost its shard")
            yield item


def refused(server: Any) -> str:
    with pytest.raises(ReplicaError) as err:
        server.generations()
    return str(err.value)


def test_a_killed_trainer_leaves_the_server_refusing_until_the_next_push(
        server: Any, model_dirs: dict[str, Path]) -> None:
    signed_push(server, perturb(load_tiny(model_dirs["llama"]), seed=1), "ok-1")
    trainer = subprocess.Popen(
        [sys.executable, "-m", "enginehooks.testing.stalling_trainer", server.engine, server.url,
         str(model_dirs["llama"]), "killed-2", "8"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, **{SECRET_ENV: SECRET}))
    try:
        assert trainer.stdout is not None
        for line in trainer.stdout:
            if line.strip() == "stalled":
                break
        else:
            pytest.fail(f"the trainer never stalled: {trainer.wait(timeout=10)}")
        trainer.send_signal(signal.SIGKILL)
    finally:
        trainer.kill()
        trainer.wait(timeout=30)
    h = handle(server)
    deadline = time.monotonic() + 60
    while h.info(30)[0]["state"] != "torn":  # the engine's receive times out (8 s)
        assert time.monotonic() < deadline, h.info(30)
        time.sleep(0.5)
    message = refused(server)
    assert "HTTP 503" in message and "killed-2" in message, message
    model = perturb(load_tiny(model_dirs["llama"]), seed=3)
    signed_push(server, model, "repaired-3")
    assert {g.version for g in server.generations()} == {"repaired-3"}


class AsksMidStream(ModuleAdapter):
    """Streams, and in the middle, once every worker says it is applying the update (its
    state file, read on this host: an RPC would queue behind the update), sends
    generation requests to the server, then keeps streaming a second later: the
    requests arrive while the update is being applied, never before it began."""

    def __init__(self, model: Any, server: Any) -> None:
        super().__init__(model)
        self.server, self.box = server, {}
        self.thread = threading.Thread(target=self.ask)
        self.beacons = [i["beacon"] for i in handle(server).info(30)]

    def wait_until_updating(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not all((Beacon.read(b) or {}).get("state") == "updating" for b in self.beacons):
            if time.monotonic() > deadline:
                raise AssertionError(f"the workers never said they were updating: "
                                     f"{[Beacon.read(b) for b in self.beacons]}")
            time.sleep(0.01)

    def ask(self) -> None:
        try:
            self.box["generations"] = self.server.generations(cold=False)
        except Exception as e:  # reported by the test
            self.box["error"] = e

    def stream(self) -> Any:
        for i, item in enumerate(super().stream()):
            if i == 5:
                self.wait_until_updating()
                self.thread.start()
                time.sleep(1.0)
            yield item


def test_a_request_during_an_update_waits_and_gets_the_new_weights(
        server: Any, model_dirs: dict[str, Path]) -> None:
    model = perturb(load_tiny(model_dirs["llama"]), seed=8)
    adapter = AsksMidStream(model, server)
    signed_push(server, adapter, "held-8")
    adapter.thread.join(90)
    assert "error" not in adapter.box, adapter.box.get("error")
    gens = adapter.box["generations"]
    assert {g.version for g in gens} == {"held-8"}
    assert [list(g.tokens) for g in gens] == hf_greedy(model, PROMPTS, NEW_TOKENS)


def test_serve_policy_marks_the_answers(server: Any, model_dirs: dict[str, Path]) -> None:
    model = perturb(load_tiny(model_dirs["llama"]), seed=4)
    with pytest.raises(RuntimeError, match="lost its shard"):  # the trainer's own error
        signed_push(server, BreaksMidStream(model), "broken-4", on_torn="serve")
    assert {g.version for g in server.generations()} == {"torn:broken-4"}
    signed_push(server, model, "ok-5", on_torn="refuse")
    assert {g.version for g in server.generations()} == {"ok-5"}


@pytest.mark.parametrize("secret", [None, "not-the-secret"], ids=["unsigned", "wrong secret"])
def test_unsigned_or_wrongly_signed_updates_are_refused_and_change_nothing(
        server: Any, model_dirs: dict[str, Path], secret: str | None) -> None:
    signed_push(server, perturb(load_tiny(model_dirs["llama"]), seed=6), "good-6")
    before = server.generations()
    with WeightSync("gloo", timeout_s=60, secret=secret) as sync:
        sync.add_replica(handle(server))
        with pytest.raises(EngineHooksError, match="refused"):
            sync.push(perturb(load_tiny(model_dirs["llama"]), seed=7), version="evil-7")
    assert handle(server).version() == "good-6"
    assert first_difference(server.generations(), before) is None


def test_a_replayed_message_is_refused(server: Any) -> None:
    m = plan([TensorSpec("model.norm.weight", "float32", (64,))], weight_version=1,
             bucket_bytes=1 << 20).to_json()
    token = sign(SECRET.encode(), "check", canonical(m))
    h = handle(server)
    h.rpc(method_name(CHECK), m, token, timeout_s=30)
    with pytest.raises(EngineHooksError, match="replay"):
        h.rpc(method_name(CHECK), m, token, timeout_s=30)
