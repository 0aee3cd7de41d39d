"""Attacks on a real vLLM server that runs WITH a shared secret and vLLM's `--api-key`
(issue 19): vLLM's API key does not guard its dev-mode control routes
(`/collective_rpc`, `/pause`, `/update_weight_version`, ...); the enginehooks endpoint
plugin does: without a token signed with the secret (for this server, fresh, never
seen) they answer 401 and change nothing, while `VLLMServer` signs its calls and
pushes. Every route the server has is classified (control, read-only, or one that
may generate), so a route vLLM adds later is noticed here. One server for every case."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enginehooks import WeightSync
from enginehooks.core.auth import SECRET_ENV, sign
from enginehooks.vllm_ext.fail_closed import CONTROL_ROUTES, route_kind
from enginehooks.wire import ROUTE_AUTH_HEADER, ROUTE_VERB, route_payload
from enginehooks_testkit.tiny import load_tiny, perturb
from tests.support import requires_vllm

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]

SECRET = "vllm-secret-server"
API_KEY = "vllm-api-key"
BEARER = {"Authorization": f"Bearer {API_KEY}"}

#: The routes of vLLM 0.32's server that may generate (everything not allow-listed).
GENERATING = {"/generative_scoring", "/invocations", "/v1/chat/completions",
              "/v1/chat/completions/batch", "/v1/completions", "/v1/messages",
              "/v1/responses", "/v1/responses/{response_id}",
              "/v1/responses/{response_id}/cancel", "/v1/systemone"}


@pytest.fixture(scope="module")
def server(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Any]:
    from enginehooks_testkit.servers import VLLMServerProcess

    env = dict(os.environ, **{SECRET_ENV: SECRET})
    log = tmp_path_factory.mktemp("logs") / "vllm-secret.log"
    with VLLMServerProcess(model_dirs["llama"], log, env=env,
                           extra_args=["--api-key", API_KEY, "--weight-transfer-config",
                                       '{"backend": "enginehooks"}']) as srv:
        yield srv


@pytest.fixture(scope="module")
def server_b(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Any]:
    """A second server with the same secret (and API key): the replica B of issue 36,
    where requests captured on their way to `server` (A) are replayed."""
    from enginehooks_testkit.servers import VLLMServerProcess

    env = dict(os.environ, **{SECRET_ENV: SECRET})
    log = tmp_path_factory.mktemp("logs") / "vllm-secret-b.log"
    with VLLMServerProcess(model_dirs["llama"], log, env=env,
                           extra_args=["--api-key", API_KEY]) as srv:
        yield srv


def identity(server: Any) -> str:
    """The server's identity, read (and checked) as a handle reads it."""
    from enginehooks.control.identity import ServerIdentity

    found = ServerIdentity(server.url, "test").get(SECRET.encode(), BEARER, 60)
    assert found
    return found


def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def get(url: str) -> Any:
    req = urllib.request.Request(url, headers=BEARER)
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def handle(server: Any) -> Any:
    from enginehooks.vllm_ext import VLLMServer

    return VLLMServer(server.url, name="vllm-secret", api_key=API_KEY, secret=SECRET)


def routes(server: Any) -> dict[str, list[str]]:
    paths = get(f"{server.url}/openapi.json")["paths"]
    return {p: sorted(m.upper() for m in ms) for p, ms in paths.items()}


def test_every_route_of_the_server_is_classified(server: Any) -> None:
    """Fails when vLLM adds a route: decide whether it is a control route (guarded by
    the secret) or one that may generate (refused while torn)."""
    assert {p for p in routes(server) if route_kind(p) == "generate"} == GENERATING


def test_control_routes_refuse_calls_without_the_enginehooks_token(
        server: Any, model_dirs: dict[str, Path]) -> None:
    h = handle(server)
    with WeightSync("gloo", timeout_s=60, secret=SECRET) as sync:
        sync.add_replica(h)
        sync.push(perturb(load_tiny(model_dirs["llama"]), seed=51), version="good-51")
    present = sorted(p for p in routes(server) if p in CONTROL_ROUTES)
    assert {"/collective_rpc", "/pause", "/update_weight_version", "/sleep",
            "/init_weight_transfer_engine", "/reset_prefix_cache"} <= set(present)
    wrong = sign(b"not-the-secret", ROUTE_VERB, "{}")
    for path in present:
        for headers in (BEARER, {**BEARER, ROUTE_AUTH_HEADER: wrong}):
            status, text = post(f"{server.url}{path}", {"new_version": "evil",
                                                        "method": "enginehooks_info"}, headers)
            assert status == 401 and "control route" in text, (path, status, text[:300])
    # our own adapter upload route: refused unsigned, and stores nothing signed by another
    from enginehooks.vllm_ext.fail_closed import ADAPTER_REMOVE_ROUTE, ADAPTER_ROUTE
    from enginehooks.wire.adapters import AdapterUpload

    upload = AdapterUpload.of_files("evil", "1", b'{"peft_type": "LORA"}', b"x" * 16).body()
    for path in (ADAPTER_ROUTE, ADAPTER_REMOVE_ROUTE):
        for headers in (BEARER, {**BEARER, ROUTE_AUTH_HEADER: wrong}):
            status, text = post(f"{server.url}{path}", upload, headers)
            assert status == 401 and "control route" in text, (path, status, text[:300])
    assert get(f"{server.url}/weight_info") == {"weight_version": "good-51"}
    assert get(f"{server.url}/is_paused") == {"is_paused": False}
    assert get(f"{server.url}/is_sleeping") == {"is_sleeping": False}
    assert h.version() == "good-51"


def test_route_tokens_are_bound_to_the_request_the_server_and_one_use(server: Any) -> None:
    me = identity(server)

    def token(path: str, body: Any, for_server: str = me) -> str:
        return sign(SECRET.encode(), ROUTE_VERB, route_payload(
            "POST", path, "", json.dumps(body).encode()), audience=[for_server])

    body = {"new_version": "signed-by-hand"}
    t = token("/update_weight_version", body)
    assert post(f"{server.url}/update_weight_version", body, {**BEARER, ROUTE_AUTH_HEADER: t}
                )[0] == 200
    status, text = post(f"{server.url}/update_weight_version", body,
                        {**BEARER, ROUTE_AUTH_HEADER: t})
    assert status == 401 and "replay" in text
    other = {"new_version": "altered"}  # the body is signed
    status, _ = post(f"{server.url}/update_weight_version", other,
                     {**BEARER, ROUTE_AUTH_HEADER: token("/update_weight_version", body)})
    assert status == 401
    for_other_server = token("/update_weight_version", other, "vllm-another-server")
    status, _ = post(f"{server.url}/update_weight_version", other,
                     {**BEARER, ROUTE_AUTH_HEADER: for_other_server})
    assert status == 401
    assert get(f"{server.url}/weight_info") == {"weight_version": "signed-by-hand"}


def post_as(url: str, body: Any, headers: dict[str, str], host: str) -> tuple[int, str]:
    """POST exactly these bytes and headers, with the `Host` header an attacker chooses."""
    return post(url, body, {**headers, "Host": host})


@pytest.mark.parametrize("path,body", [
    ("/update_weight_version", {"new_version": "replayed"}),
    ("/pause", {}),
    ("/init_weight_transfer_engine", {"init_info": {"endpoint": {"transport": "gloo"}}}),
])
def test_a_request_captured_for_one_server_changes_nothing_at_another(
        server: Any, server_b: Any, path: str, body: Any) -> None:
    """Issue 36: a signed request captured on its way to replica A and replayed byte for
    byte to replica B, with `Host: A`, is refused by B (its token names A's identity,
    which B is not; no header is read), and B changes nothing; the same request is still
    good at A."""
    from enginehooks.wire import route_headers

    a, b = identity(server), identity(server_b)
    assert a != b
    host_a = server.url.removeprefix("http://")
    captured = {**BEARER, **route_headers(SECRET, f"{server.url}{path}", body, a)}
    before_b = get(f"{server_b.url}/weight_info")
    status, text = post_as(f"{server_b.url}{path}", body, captured, host_a)
    assert status == 401 and "signed for another replica" in text, (status, text[:300])
    assert get(f"{server_b.url}/weight_info") == before_b
    assert get(f"{server_b.url}/is_paused") == {"is_paused": False}
    if path == "/update_weight_version":  # still a genuine, unused request for A
        assert post(f"{server.url}{path}", body, captured)[0] == 200
        assert get(f"{server.url}/weight_info") == {"weight_version": "replayed"}


def test_a_servers_identity_is_its_workers_deployment_and_signed(server: Any) -> None:
    from enginehooks.wire import IDENTITY_ROUTE

    a = identity(server)
    assert handle(server).info(60)[0]["deployment"] == a  # what the workers answer to
    raw = get(f"{server.url}{IDENTITY_ROUTE}?nonce=abc")
    assert raw["server"] == a and raw["nonce"] == "abc" and len(raw["mac"]) == 64


def test_a_join_captured_for_one_deployment_is_refused_by_another(
        server: Any, server_b: Any) -> None:
    """The workers' own tokens (join, check, receive) name their deployment when the
    trainer cannot ask for each worker's id (vLLM's own weight-transfer calls): a join
    signed for A's workers, sent to B's (through B's guarded route, properly signed for
    B), is refused by B's workers and B stays in no group."""
    from enginehooks import wire
    from enginehooks.core.auth import AuthError

    a = handle(server).info(60)[0]["deployment"]
    hb = handle(server_b)
    assert a and a != hb.info(60)[0]["deployment"]
    endpoint = {"transport": "gloo", "host": "127.0.0.1", "port": 1, "group": "g-of-a",
                "timeout_s": 5, "world_size": 2}
    join_for_a = wire.token(SECRET.encode(), "join", [a], endpoint=endpoint, rank_offset=1)
    with pytest.raises(AuthError, match="signed for another replica"):
        hb.call("join", json.dumps(endpoint), 1, join_for_a, timeout_s=60)
    assert hb.info(60)[0]["group"] is None


def test_a_signed_push_through_vllms_own_api_lands_and_its_tokens_bind_elsewhere(
        server: Any, model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Through vLLM's weight-transfer calls the trainer cannot ask the workers for their
    ids, so its tokens name nobody: the workers take such a token on that path only
    (`EngineSide.anonymous_audience`), where the route guard binds the HTTP request to
    this server. The same kind of token sent through the worker extension's verbs is
    refused."""
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from enginehooks import wire as protocol
    from enginehooks.core.auth import AuthError
    from enginehooks.vllm_ext.transfer_trainer import EnginehooksTrainerInitInfo

    monkeypatch.setenv(SECRET_ENV, SECRET)
    engine = WeightTransferTrainerFactory.trainer_init(
        EnginehooksTrainerInitInfo(rank=0, world_size=2, timeout_s=60, bucket_bytes=64 << 10),
        client=handle(server), source=ModuleSource(perturb(load_tiny(model_dirs["llama"]),
                                                           seed=53)))
    try:
        report = engine.send_weights(weight_version="api-53")
    finally:
        engine.shutdown()
    assert report.ok
    assert get(f"{server.url}/weight_info") == {"weight_version": "api-53"}
    endpoint = {"transport": "gloo", "host": "127.0.0.1", "port": 1, "group": "g-any",
                "timeout_s": 5, "world_size": 2}
    nameless = protocol.token(SECRET.encode(), "join", endpoint=endpoint, rank_offset=1)
    with pytest.raises(AuthError, match="signed for another replica"):
        handle(server).call("join", json.dumps(endpoint), 1, nameless, timeout_s=60)


def test_the_handle_signs_vllms_native_controls(server: Any) -> None:
    h = handle(server)
    h.pause(30)
    try:
        assert h.is_paused()
    finally:
        h.resume(30)
    assert not h.is_paused()
