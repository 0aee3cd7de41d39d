"""Attacks on a real vLLM server that runs WITHOUT a shared secret (issue 19): the
control plane stays in step after a timed-out RPC, a torn engine refuses every route
that may generate (not only the ones a prefix list knew), a missing state file fails
closed, `/weight_info` says torn, errors keep their class over HTTP, a trainer with a
secret is refused by this engine at once (also through vLLM's own weight-transfer
API), and automatic version numbers never go backwards. One server serves every case
(the session's open server of tests/vllm/conftest.py: a vLLM CPU server takes about\na minute to start)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from enginehooks import WeightSync
from enginehooks.core.auth import SECRET_ENV, AuthError
from enginehooks.core.errors import ConfigError, ManifestError, ReplicaError, TransportError
from enginehooks.core.manifest import plan
from enginehooks.trainer_side import ModuleAdapter
from enginehooks_testkit.engines import NEW_TOKENS, PROMPTS
from enginehooks_testkit.tiny import hf_greedy, load_tiny, perturb
from tests.support import have, requires_vllm

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]

if have("vllm"):  # backend "enginehooks" of vLLM's weight-transfer routes
    from tests.support.entry_points import expose_entry_points

    expose_entry_points("vllm.general_plugins")


@pytest.fixture(scope="module")
def server(vllm_server: Any) -> Any:
    """The session's open vLLM server (tests/vllm/conftest.py: llama, backend
    "enginehooks", no secret): the same engine arguments this module started on its own,
    shared to save one server start (~25 s in CI). Every case here leaves it serving
    with a good push."""
    return vllm_server


def handle(server: Any) -> Any:
    from enginehooks.vllm_ext import VLLMServer

    return VLLMServer(server.url, name="vllm-open", secret=b"")


def post(url: str, body: Any, timeout_s: float = 60.0) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def push(server: Any, model: Any, version: Any, **options: Any) -> Any:
    with WeightSync("gloo", timeout_s=60, secret=b"", **options) as sync:
        sync.add_replica(handle(server))
        return sync.push(model, version=version)


def load_specs(model_dirs: dict[str, Path]) -> Any:
    return ModuleAdapter(load_tiny(model_dirs["llama"])).specs()


def test_errors_keep_their_class_over_http(server: Any, model_dirs: dict[str, Path]) -> None:
    """A worker's error reaches the trainer as the same class (it became a
    `ReplicaError` with the class in its text before)."""
    h = handle(server)
    full = plan(list(load_specs(model_dirs)), weight_version=1, bucket_bytes=1 << 20).to_json()
    with pytest.raises(TransportError, match="has not joined"):
        h.call("receive", full, "no-such-group", timeout_s=60)
    with pytest.raises(ManifestError, match="missing from the update"):
        h.call("receive", plan([], weight_version=1, bucket_bytes=1 << 20).to_json(),
               "no-such-group", timeout_s=60)
    with pytest.raises(ConfigError, match="transport"):
        h.call("join", json.dumps({"transport": 5}), 1, timeout_s=60)


def test_workers_without_the_extension_are_named_with_the_fix(server: Any) -> None:
    """vLLM answers a method its workers lack with `'CPUWorker' object has no attribute
    'enginehooks_...'` (HTTP 500), what a server started without the worker extension
    answers every enginehooks call with: the handle says which flag to add, at once."""
    from enginehooks.core.deadline import Deadline

    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"--worker-extension-cls enginehooks\.vllm_ext"):
        handle(server)._tagged_rpc("enginehooks_not_in_this_worker", deadline=Deadline.after(60))
    assert time.monotonic() - t0 < 30
    assert handle(server).info(30)[0]["rank"] == 0  # and nothing is out of step after it


class BreaksMidStream(ModuleAdapter):
    def stream(self) -> Any:
        for i, item in enumerate(super().stream()):
            if i == 5:
                raise RuntimeError("trainer rank lost its shard")
            yield item


#: Routes that may generate, including those a prefix list missed (issue 19), and one
#: vLLM does not have (a route added later must be refused too).
GENERATING = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations",
              "/v1/messages", "/generative_scoring", "/v1/chat/completions/batch",
              "/v1/systemone", "/inference/v1/generate", "/a-route-vllm-adds-later"]
SERVED_WHILE_TORN = ["/health", "/v1/models", "/metrics", "/version", "/is_paused"]


def test_a_torn_engine_refuses_every_route_that_may_generate(
        server: Any, model_dirs: dict[str, Path]) -> None:
    model = perturb(load_tiny(model_dirs["llama"]), seed=42)
    with pytest.raises(RuntimeError, match="lost its shard"):
        push(server, BreaksMidStream(model), "broken-42")
    assert handle(server).info(30)[0]["state"] == "torn"
    for path in GENERATING:
        status, text = post(f"{server.url}{path}", {"model": server.model, "prompt": [1, 2],
                                                     "max_tokens": 2})
        assert status == 503 and "broken-42" in text, (path, status, text[:300])
    for path in SERVED_WHILE_TORN:
        assert get(f"{server.url}{path}")[0] == 200, path
    # A trainer that died before recording `torn` as vLLM's weight version leaves the
    # old one there; /weight_info still says torn, from the workers' own state. (This
    # handle records it, in the background: wait for that first.)
    deadline = time.monotonic() + 30
    while json.loads(get(f"{server.url}/weight_info")[1])["weight_version"] != "torn":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert post(f"{server.url}/update_weight_version", {"new_version": "stale"})[0] == 200
    assert json.loads(get(f"{server.url}/weight_info")[1])["weight_version"] == "torn"
    push(server, model, "repaired-43")
    assert json.loads(get(f"{server.url}/weight_info")[1])["weight_version"] == "repaired-43"
    status, text = post(f"{server.url}/v1/completions", {"model": server.model,
                                                         "prompt": [1, 2], "max_tokens": 2})
    assert status == 200, text[:300]


def test_a_missing_state_file_fails_closed(server: Any) -> None:
    beacon = Path(handle(server).info(30)[0]["beacon"])
    moved = beacon.with_name("moved-away.json")
    body = {"model": server.model, "prompt": [1, 2], "max_tokens": 2}
    assert post(f"{server.url}/v1/completions", body)[0] == 200
    beacon.rename(moved)
    try:
        status, text = post(f"{server.url}/v1/completions", body)
        assert status == 503 and "state file" in text and "missing" in text, (status, text)
        assert get(f"{server.url}/health")[0] == 200
    finally:
        moved.rename(beacon)
    assert post(f"{server.url}/v1/completions", body)[0] == 200


def vllm_api_push(server: Any, model: Any, versions: list[str | None],
                  world_size: int = 2) -> list[Any]:
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from enginehooks.vllm_ext.transfer_trainer import EnginehooksTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        EnginehooksTrainerInitInfo(rank=0, world_size=world_size, timeout_s=60,
                                   bucket_bytes=64 << 10),
        client=handle(server), source=ModuleSource(model))
    try:
        return [engine.send_weights(weight_version=v) for v in versions]
    finally:
        engine.shutdown()


def test_automatic_versions_never_go_backwards(server: Any, model_dirs: dict[str, Path]) -> None:
    model = perturb(load_tiny(model_dirs["llama"]), seed=44)
    reports = vllm_api_push(server, model, ["10", None])
    assert [str(r.version) for r in reports] == ["10", "11"]
    assert json.loads(get(f"{server.url}/weight_info")[1])["weight_version"] == "11"


def test_a_trainer_with_a_secret_is_refused_at_once_through_vllms_own_api(
        server: Any, model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's calls cannot ask the workers whether they verify signatures; the engine
    refuses the signed join itself, within seconds, saying the fix."""
    monkeypatch.setenv(SECRET_ENV, "the-trainer-has-a-secret")
    before = handle(server).version()
    t0 = time.monotonic()
    with pytest.raises((AuthError, ReplicaError), match=r"no shared secret.*ENGINEHOOKS_SECRET"):
        vllm_api_push(server, perturb(load_tiny(model_dirs["llama"]), seed=45), ["evil"])
    assert time.monotonic() - t0 < 30  # the push's timeout_s is 60
    assert handle(server).version() == before


def test_a_wrong_world_size_is_refused_at_once_with_the_fix(
        server: Any, model_dirs: dict[str, Path]) -> None:
    """A trainer that counts 2 workers for this 1-worker server (world_size=3): the
    worker refuses the join at once saying the world size to use, and the push ends on
    every side within seconds (before: the sender waited out timeout_s for a second
    worker that never came)."""
    before = handle(server).info(30)[0]
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"counts 2 worker\(s\).*runs 1: set world_size to 2"):
        vllm_api_push(server, perturb(load_tiny(model_dirs["llama"]), seed=46), ["w3"],
                      world_size=3)
    assert time.monotonic() - t0 < 20  # the push's timeout_s is 60
    after = handle(server).info(30)[0]
    assert (after["state"], after["version"]) == (before["state"], before["version"])


def test_a_timed_out_rpc_cannot_shift_the_answers_of_later_calls(
        server: Any, model_dirs: dict[str, Path]) -> None:
    """vLLM keeps the answer of a `/collective_rpc` call that timed out in its worker
    queue and hands it to the next call: one POST with `"timeout": 0.001` used to
    shift every later answer by one (pushes failed at check, and generation crashed
    vLLM's engine core, which received an RPC answer for a model step). The endpoint
    plugin refuses such calls, and the handles send none (if they did, the push below
    would be refused): the next push succeeds and the engine serves its weights."""
    m = plan([*load_specs(model_dirs)], weight_version="probe", bucket_bytes=1 << 20).to_json()
    status, text = post(f"{server.url}/collective_rpc", {
        "method": "enginehooks_check", "args": [m], "timeout": 0.001})
    assert status == 400 and "timeout" in text, (status, text[:500])
    # Nothing is out of step: an untagged call gets its own answer (info, not the
    # check's list of problems).
    status, text = post(f"{server.url}/collective_rpc", {"method": "enginehooks_info"})
    assert status == 200 and json.loads(text)["results"][0]["rank"] == 0, text[:500]
    model = perturb(load_tiny(model_dirs["llama"]), seed=41)
    report = push(server, model, "after-timeout")
    assert report.ok
    assert handle(server).version() == "after-timeout"
    gens = server.generations()
    assert {g.version for g in gens} == {"after-timeout"}
    assert [list(g.tokens) for g in gens] == hf_greedy(model, PROMPTS, NEW_TOKENS)


def test_weight_info_says_torn_after_a_killed_trainer(
        server: Any, model_dirs: dict[str, Path]) -> None:
    """A trainer killed mid-push records nothing (vLLM's weight version still names
    the last good push); `/weight_info` says `torn` from the workers' own state as soon
    as their receive gives up, and the next push repairs it."""
    env = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, "ENGINEHOOKS_SECRET_FILE")}
    trainer = subprocess.Popen(
        [sys.executable, "-m", "enginehooks_testkit.stalling_trainer", "vllm", server.url,
         str(model_dirs["llama"]), "killed-50", "8"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    assert trainer.stdout is not None
    out = trainer.stdout
    threading.Thread(target=lambda: [lines.put(x) for x in out], daemon=True).start()
    try:
        deadline = time.monotonic() + 180
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line.strip() == "stalled":
                break
        # mid-update (the workers wait in their receive): the state route answers at
        # once from the workers' state files, where /weight_info would wait
        t0 = time.monotonic()
        status, text = get(f"{server.url}/enginehooks/state")
        assert status == 200 and time.monotonic() - t0 < 5, (status, text[:300])
        assert json.loads(text)["weights"] == "updating", text[:300]
        trainer.send_signal(signal.SIGKILL)
    finally:
        trainer.kill()
        trainer.wait(timeout=30)
    deadline = time.monotonic() + 60
    while True:  # the workers' receive gives up after the trainer's 8 s
        info = json.loads(get(f"{server.url}/weight_info")[1])
        if info["weight_version"] == "torn":
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.5)
    assert "killed-50" in info["enginehooks"], info
    state = json.loads(get(f"{server.url}/enginehooks/state")[1])
    assert state["weights"].startswith("torn:") and state["workers"][0]["state"] == "torn"
    model = perturb(load_tiny(model_dirs["llama"]), seed=47)
    push(server, model, "after-kill")
    assert json.loads(get(f"{server.url}/weight_info")[1])["weight_version"] == "after-kill"
