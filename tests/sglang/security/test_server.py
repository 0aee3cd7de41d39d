"""Attacks on real SGLang servers (issue 19), run in the SGLang environment:

- without `--api-key`, SGLang serves its admin routes (`/update_weights_from_disk`,
  `/update_weights_from_distributed`, `/init_weights_update_group`,
  `/release_memory_occupation`, `/update_weight_version`, ...) to anyone: with a shared
  secret, the enginehooks plugin refuses every route SGLang marks as admin (but the
  three `OPEN_ADMIN_ROUTES`) unless it carries a token signed with the secret (bound to
  body and host, used once), while generation stays open, and `SGLangServer` (signing)
  still pushes;
- a server started without our plugin (`SGLANG_PLUGINS` not listing it) is named with
  the fix at once, not as a bare HTTP 404.

Two servers, one after the other (each about 30-40 s to start on CPU)."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import have

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not have("sglang"), reason="SGLang runs in its own environment "
                                 "(scripts/test.sh runs this file there)")]

SECRET = "sglang-admin-secret"


def post(url: str, body: Any, headers: dict[str, str] | None = None,
         method: str = "POST") -> tuple[int, str]:
    data = None if method in ("GET", "DELETE") else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def sglang_admin_routes() -> list[tuple[str, str]]:
    """(method, path) of every route SGLang's own source marks
    `@auth_level(AuthLevel.ADMIN_*)`, read from the source (not from the running app the
    guard reads), so the test does not take the guard's word for which are admin."""
    spec = importlib.util.find_spec("sglang.srt.entrypoints.http_server")
    assert spec is not None and spec.origin
    tree = ast.parse(Path(spec.origin).read_text())
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        decorators = [ast.unparse(d) for d in node.decorator_list]
        if not any(d.startswith("auth_level(AuthLevel.ADMIN") for d in decorators):
            continue
        for d in node.decorator_list:
            if (isinstance(d, ast.Call) and ast.unparse(d.func).startswith("app.")
                    and d.args and isinstance(d.args[0], ast.Constant)):
                kind = ast.unparse(d.func).removeprefix("app.")
                methods = [kind.upper()] if kind != "api_route" else [
                    str(m.value) for k in d.keywords if k.arg == "methods"
                    for m in getattr(k.value, "elts", []) if isinstance(m, ast.Constant)]
                out += [(m, str(d.args[0].value)) for m in methods]
    return sorted(set(out))


def launch(model_dirs: dict[str, Path], log: Path, **env: str) -> Any:
    from enginehooks.core.auth import SECRET_ENV
    from enginehooks_testkit.servers import SGLangServerProcess

    base = {k: v for k, v in os.environ.items()
            if k not in (SECRET_ENV, "ENGINEHOOKS_SECRET_FILE", "SGLANG_PLUGINS")}
    return SGLangServerProcess(model_dirs["llama"], log, env={**base, **env})


def test_a_server_without_our_plugin_is_named_with_the_fix(
        model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """SGLang answers 404 for `/enginehooks/rpc` when our plugin is not loaded: the
    trainer hears which setting to fix, in seconds."""
    from enginehooks import ConfigError, WeightSync
    from enginehooks.sglang_ext import SGLangServer
    from enginehooks_testkit.tiny import load_tiny, perturb

    with launch(model_dirs, tmp_path / "sglang-no-plugin.log",
                SGLANG_PLUGINS="not-enginehooks") as srv:
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match=r"plugin is not loaded.*SGLANG_PLUGINS"):
            SGLangServer(srv.url, name="no-plugin").info(60)
        with WeightSync("gloo", timeout_s=60) as sync:
            sync.add_replica(SGLangServer(srv.url, name="no-plugin"))
            with pytest.raises(ConfigError, match=r"no-plugin.*SGLANG_PLUGINS"):
                sync.push(perturb(load_tiny(model_dirs["llama"]), seed=70), version=1)
        assert time.monotonic() - t0 < 30  # the push's timeout_s is 60


@pytest.fixture(scope="module")
def guarded(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Any]:
    from enginehooks.core.auth import SECRET_ENV

    log = tmp_path_factory.mktemp("logs") / "sglang-secret.log"
    with launch(model_dirs, log, SGLANG_PLUGINS="enginehooks", **{SECRET_ENV: SECRET}) as srv:
        yield srv


def served_version(srv: Any) -> str:
    status, text = post(f"{srv.url}/generate", {
        "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
    assert status == 200, text[:300]  # generation needs no token
    return str(json.loads(text)["meta_info"]["weight_version"])


def test_every_admin_route_is_refused_without_a_token(guarded: Any) -> None:
    routes = sglang_admin_routes()
    assert {"/update_weights_from_disk", "/update_weights_from_distributed",
            "/init_weights_update_group", "/release_memory_occupation",
            "/update_weight_version"} <= {p for _, p in routes}, routes
    before = served_version(guarded)
    # Left out: a templated route such as `/dumper/{method}` (it exists only when
    # SGLang's dumper is on), and the few left open on purpose, each with its reason
    # (`plugin.OPEN_ADMIN_ROUTES`: none changes weights or labels).
    from enginehooks.sglang_ext.plugin import OPEN_ADMIN_ROUTES

    assert set(OPEN_ADMIN_ROUTES) == {"/freeze_gc", "/flush_cache", "/enginehooks/rpc"}
    checked = [r for r in routes if "{" not in r[1] and r[1] not in OPEN_ADMIN_ROUTES]
    assert len(checked) >= 40, checked
    for method, path in checked:
        status, text = post(f"{guarded.url}{path}", {"new_version": "evil", "model_path": "/"},
                            method=method)
        assert status == 401 and "shared secret" in text, (method, path, status, text[:300])
    # Nothing changed: the weights' version is the one served before.
    assert served_version(guarded) == before
    for path in ("/health", "/get_model_info", "/v1/models"):
        req = urllib.request.Request(f"{guarded.url}{path}")
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200, path


def test_route_tokens_are_bound_to_body_and_used_once(guarded: Any) -> None:
    from enginehooks.control.identity import ServerIdentity
    from enginehooks.wire import route_headers

    url = f"{guarded.url}/update_weight_version"
    body = {"new_version": "signed-1", "abort_all_requests": False}
    me = ServerIdentity(guarded.url, "test").get(SECRET.encode(), {}, 60)
    assert me and me.startswith("sglang-")
    # a token for another server (issue 36: the audience is the server's identity, never
    # the Host header) changes nothing here
    status, text = post(url, body, {**route_headers(SECRET, url, body, "sglang-another"),
                                    "Host": guarded.url.removeprefix("http://")})
    assert status == 401 and "signed for another replica" in text, (status, text[:300])
    headers = route_headers(SECRET, url, body, me)
    status, text = post(url, {**body, "new_version": "evil"}, headers)
    assert status == 401 and "does not match" in text, (status, text[:300])
    status, text = post(url, body, headers)
    assert status == 200, (status, text[:300])
    assert served_version(guarded) == "signed-1"
    status, text = post(url, body, headers)  # the same token again
    assert status == 401 and "replay" in text.lower(), (status, text[:300])
    wrong = route_headers("not-the-secret", url, body, me)
    assert post(url, body, wrong)[0] == 401


def test_a_signing_trainer_still_pushes_pauses_and_flushes(
        guarded: Any, model_dirs: dict[str, Path]) -> None:
    from enginehooks import WeightSync
    from enginehooks.sglang_ext import SGLangServer
    from enginehooks_testkit.engines import NEW_TOKENS, PROMPTS
    from enginehooks_testkit.tiny import hf_greedy, load_tiny, perturb

    model = perturb(load_tiny(model_dirs["llama"]), seed=71)
    handle = SGLangServer(guarded.url, name="sglang-secret")  # adopts the sync's secret
    with WeightSync("gloo", timeout_s=60, pause=True, secret=SECRET) as sync:
        sync.add_replica(handle)
        assert sync.push(model, version="signed-push").ok
    assert served_version(guarded) == "signed-push"
    sp = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    got = [json.loads(post(f"{guarded.url}/generate", {"input_ids": p,
                                                      "sampling_params": sp})[1])["output_ids"]
           for p in PROMPTS]
    assert got == hf_greedy(model, PROMPTS, NEW_TOKENS)
