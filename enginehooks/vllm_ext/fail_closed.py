"""Fail closed on vLLM: no generation from weights the engine does not fully hold.

While a worker is applying an update, or after an update failed after data moved
("torn"), vLLM's front ends refuse generation under the policy `on_torn="refuse"`
(the default) with an error naming the version and the reason; under "serve" they
serve and mark the answers. Each front end reads the workers' published state
(`engine/beacon.py`):

- the API server: an endpoint plugin (`EnginehooksEndpoints`, entry point
  `vllm.endpoint_plugins`; vLLM loads endpoint plugins only when they are named in
  `VLLM_PLUGINS`, so start servers with `VLLM_PLUGINS=enginehooks`) adds a middleware.
  Every route is a generation route except an explicit allow-list (`READ_ONLY_ROUTES`,
  `CONTROL_ROUTES`, `/weight_info`): nothing is let through by prefix, so a route vLLM
  adds later is refused while torn rather than served. A generation request that
  arrives while an update is applied is held until the update ends (at most
  `ENGINEHOOKS_HOLD_S`, default 60 s) and then served by the new weights, or refused if
  the update left the engine torn; refused requests get HTTP 503 with a JSON body; a
  worker whose state file is missing counts as torn (fail closed). Every generation
  response carries `X-Enginehooks-Weight-Version` (or `mixed:a->b` when an update
  landed while it ran) and, when served torn, `X-Enginehooks-Torn`. `/weight_info`
  answers `torn` as soon as a worker's state says so. With a shared secret in the
  server's environment, the control routes (vLLM's dev routes: `/collective_rpc`,
  `/pause`, `/update_weight_version`, ...; vLLM's `--api-key` does not guard them)
  require a token signed with it (`X-Enginehooks-Auth`, sent by `VLLMServer`), or are
  refused with HTTP 401;
- in-process `vllm.LLM` / `AsyncLLM`: the handles (`VLLMEngine`, `VLLMAsyncEngine`)
  guard the engine's `generate` / `chat`, which raise `EngineTorn`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import time
from argparse import Namespace
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from enginehooks.core.auth import AuthError, Verifier, configured_server_id, load_secret
from enginehooks.core.errors import ConfigError, EngineHooksError, EngineTorn
from enginehooks.engine.adapter_store import AdapterStore
from enginehooks.engine.beacon import Beacon
from enginehooks.engine.side import refusal_of
from enginehooks.wire import (
    IDENTITY_ROUTE,
    ROUTE_AUTH_HEADER,
    identity_answer,
    server_verifier,
    verify_route,
)
from enginehooks.wire.adapters import AdapterUpload

log = logging.getLogger("enginehooks.vllm")

#: Routes that never generate and change nothing: served whatever the weights' state.
READ_ONLY_ROUTES = frozenset({
    "/health", "/ping", "/ready", "/readyz", "/metrics", "/load", "/version", "/v1/models",
    "/server_info", "/is_paused", "/is_sleeping", "/get_world_size", "/kv_event_sources",
    "/is_scaling_elastic_ep", "/tokenizer_info", "/fault_tolerance/status", "/tokenize",
    "/detokenize", "/v1/messages/count_tokens", "/docs", "/docs/oauth2-redirect", "/redoc",
    "/openapi.json",
})
#: vLLM's control routes (dev mode, RL, LoRA, sleep, profiling, scaling): they change
#: the engine but generate nothing; served while torn (a push repairs the engine through
#: them) and, with a shared secret, only with a signed token.
CONTROL_ROUTES = frozenset({
    "/collective_rpc", "/pause", "/resume", "/update_weight_version", "/reload_weights",
    "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache", "/sleep", "/wake_up",
    "/release_kv_cache_memory", "/init_weight_transfer_engine", "/start_weight_update",
    "/start_draft_weight_update", "/update_weights", "/finish_weight_update",
    "/shutdown_weight_transfer_engine", "/weight_checker", "/abort_requests",
    "/scale_elastic_ep", "/start_profile", "/stop_profile", "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
})
WEIGHT_INFO = "/weight_info"
#: What the workers hold, read from their state files without an RPC (never waits).
STATE_ROUTE = "/enginehooks/state"
#: A LoRA adapter version uploaded into this server's `AdapterStore` (then loaded through
#: vLLM's own `/v1/load_lora_adapter`), and its removal: control routes, signed.
ADAPTER_ROUTE = "/enginehooks/adapter"
ADAPTER_REMOVE_ROUTE = "/enginehooks/adapter/remove"


def route_kind(path: str) -> str:
    """"control", "read" (never generates), "weight_info", or "generate" (everything
    else: an unknown route is treated as one that generates)."""
    path = path.rstrip("/") or "/"
    if path == STATE_ROUTE:
        return "read"
    if path in CONTROL_ROUTES or path.startswith("/enginehooks/"):
        return "control"
    if path in READ_ONLY_ROUTES:
        return "read"
    if path == WEIGHT_INFO:
        return "weight_info"
    return "generate"


def rpc_deadline(body: bytes) -> Any:
    """The `timeout` a `/collective_rpc` body asks vLLM for (None: none, or not JSON,
    which vLLM itself refuses)."""
    try:
        data = json.loads(body or b"{}")
    except ValueError:
        return None
    return data.get("timeout") if isinstance(data, dict) else None


def _missing(path: str) -> dict[str, Any]:
    return {"state": "torn", "version": None, "updating_to": None, "failed_version": None,
            "on_torn": "refuse",
            "reason": f"the worker's state file {path} is missing, so its weights are unknown"}


def states(beacons: Sequence[str]) -> list[dict[str, Any]]:
    """Every worker's published state; a worker whose state file is missing counts as
    torn (fail closed: never serve weights nobody vouches for)."""
    return [s if s is not None else _missing(b) for b, s in ((b, Beacon.read(b)) for b in beacons)]


def refusal(beacons: Sequence[str]) -> dict[str, Any] | None:
    """Why generation must be refused now, from the workers' published states."""
    for s in states(beacons):
        if s.get("on_torn") == "refuse" and s.get("state") in ("updating", "torn"):
            return refusal_of(s)
    return None


HOLD_ENV = "ENGINEHOOKS_HOLD_S"


def hold_s() -> float:
    """How long a front end holds a request that arrives during an update (a bad value
    is logged and the default used: a typo must not turn every request into an error)."""
    text = os.environ.get(HOLD_ENV, "60")
    try:
        return max(0.0, float(text))
    except ValueError:
        log.warning("enginehooks: %s=%r is not a number of seconds; holding 60 s", HOLD_ENV, text)
        return 60.0


async def settled_refusal(beacons: Sequence[str], hold: float) -> dict[str, Any] | None:
    """`refusal`, after holding the caller while an update is being applied (up to
    `hold` seconds): an update that succeeds costs a request some latency, not an
    error; one that fails refuses it as torn; one still running after `hold` refuses
    it as updating."""
    deadline = time.monotonic() + hold
    while True:
        refused = refusal(beacons)
        if refused is None or refused["state"] != "updating" or time.monotonic() >= deadline:
            return refused
        await asyncio.sleep(0.02)  # the beacons are files the workers rewrite


def label(beacons: Sequence[str]) -> str:
    """The weight version every worker holds, or what is wrong with it."""
    ss = states(beacons)
    if any(s.get("state") == "torn" for s in ss):
        return "torn:" + ",".join(sorted({str(s.get("failed_version")) for s in ss
                                          if s.get("state") == "torn"}))
    if any(s.get("state") == "updating" for s in ss):
        return "updating"
    versions = sorted({str(s.get("version")) for s in ss})
    return versions[0] if len(versions) == 1 else "mixed:" + ",".join(versions)


# -- in-process ----------------------------------------------------------------------------
def guard(engine: Any, beacons: Callable[[], Sequence[str]],
          methods: Sequence[str] = ("generate", "chat")) -> None:
    """Make `engine`'s generation methods refuse while a worker is updating or torn
    (policy "refuse"), and tag served outputs `enginehooks_weight_version`."""
    for name in methods:
        original = getattr(engine, name, None)
        if original is None or getattr(original, "__enginehooks_guard__", False):
            continue

        @functools.wraps(original)
        def guarded(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            paths = beacons()
            refused = refusal(paths)
            if refused is not None:
                raise EngineTorn(refused)
            before = label(paths)
            out = _original(*args, **kwargs)
            after = label(paths)
            tag = before if before == after else f"mixed:{before}->{after}"
            for o in out if isinstance(out, list) else []:
                with contextlib.suppress(AttributeError):  # outputs without a __dict__
                    o.enginehooks_weight_version = tag
            return out

        guarded.__enginehooks_guard__ = True  # type: ignore[attr-defined]
        setattr(engine, name, guarded)


def guard_async(engine: Any, beacons: Callable[[], Awaitable[Sequence[str]]]) -> None:
    """`guard` for `AsyncLLM.generate`, an async generator; `beacons` is awaited (it runs
    on the engine's own event loop, which a blocking call would deadlock)."""
    original = getattr(engine, "generate", None)
    if original is None or getattr(original, "__enginehooks_guard__", False):
        return

    @functools.wraps(original)
    async def guarded(*args: Any, **kwargs: Any) -> Any:
        refused = await settled_refusal(await beacons(), hold_s())
        if refused is not None:
            raise EngineTorn(refused)
        async for out in original(*args, **kwargs):
            yield out

    guarded.__enginehooks_guard__ = True  # type: ignore[attr-defined]
    engine.generate = guarded


# -- the API server ------------------------------------------------------------------------
def adapter_answer(state: Any, path: str, body: bytes) -> tuple[dict[str, Any], int]:
    """Store (or remove) an adapter version: (JSON answer, HTTP status). Bad input is
    refused with its reason (400) and changes nothing."""
    try:
        raw = json.loads(body or b"{}")
        if getattr(state, "enginehooks_adapters", None) is None:
            state.enginehooks_adapters = AdapterStore()
        store: AdapterStore = state.enginehooks_adapters
        if path.rstrip("/") == ADAPTER_REMOVE_ROUTE:
            if not isinstance(raw, dict):
                raise ConfigError("an adapter removal is a JSON object")
            return {"removed": store.remove(str(raw.get("name")), str(raw.get("version")))}, 200
        return {"path": str(store.put(AdapterUpload.from_body(raw)))}, 200
    except (EngineHooksError, ValueError) as e:
        return {"error": {"message": f"enginehooks: {e}", "type": type(e).__name__,
                          "code": 400}}, 400


def server_id(state: Any) -> str:
    """This server's identity, the audience of its route tokens: `ENGINEHOOKS_SERVER_ID`,
    else the deployment id its workers share (`EngineSide.deployment`, read once at
    start), else an id of this process, drawn once (several API processes of one server
    without workers that answer then need `ENGINEHOOKS_SERVER_ID`)."""
    server = getattr(state, "enginehooks_server_id", None)
    if not server:
        import uuid

        server = state.enginehooks_server_id = f"vllm-{uuid.uuid4().hex}"
        log.warning("enginehooks: no worker told this server's deployment id; its route "
                    "tokens name %s, an id of this API process (set ENGINEHOOKS_SERVER_ID when "
                    "several API processes serve one engine)", server)
    return str(server)


class EnginehooksEndpoints:
    """vLLM endpoint plugin (`vllm.endpoint_plugins`, name `enginehooks`): the fail-closed
    middleware of the API server (see the module docstring)."""

    name = "enginehooks"
    required_tasks = None

    def attach_router(self, app: Any) -> None:
        from fastapi.responses import JSONResponse

        secret = load_secret()  # a secret file that cannot be read stops the server here
        verifiers: dict[str, Verifier] = {}

        def route_verifier(state: Any) -> Verifier | None:
            if not secret:
                return None
            server = server_id(state)
            if server not in verifiers:
                verifiers[server] = server_verifier(secret, server)
            return verifiers[server]

        @app.middleware("http")
        async def enginehooks_fail_closed(request: Any, call_next: Any) -> Any:
            path = request.url.path
            kind = route_kind(path)
            beacons: Sequence[str] = getattr(request.app.state, "enginehooks_beacons", ())
            if path.rstrip("/") == STATE_ROUTE:
                # the workers' published state files: answers at once, also while the
                # engine core applies an update (vLLM's /weight_info waits for it)
                return JSONResponse(content={"weights": label(beacons) if beacons else None,
                                             "workers": states(beacons)})
            if path.rstrip("/") == IDENTITY_ROUTE:
                return JSONResponse(content=identity_answer(
                    secret, server_id(request.app.state), request.query_params.get("nonce", "")))
            if kind == "control":
                body = await request.body()
                if path.rstrip("/") == "/collective_rpc" and rpc_deadline(body) is not None:
                    return JSONResponse(status_code=400, content={"error": {
                        "message": "enginehooks: /collective_rpc with a \"timeout\" is refused: "
                                   "vLLM keeps the answer of a call that times out in its "
                                   "worker queue and hands it to the next call (generation "
                                   "included), which breaks the engine until it restarts. "
                                   "Send no timeout and bound the wait on the client side.",
                        "type": "BadRequest", "code": 400}})
                verifier = route_verifier(request.app.state)
                if verifier is not None:
                    try:
                        verify_route(verifier, request.method, path, request.url.query, body,
                                     request.headers.get(ROUTE_AUTH_HEADER))
                    except AuthError as e:
                        return JSONResponse(status_code=401, content={"error": {
                            "message": f"enginehooks: {path} is a control route and this "
                                       f"engine has a shared secret: {e} (enginehooks' "
                                       "VLLMServer signs its calls; vLLM's --api-key does "
                                       "not guard these routes)",
                            "type": "AuthError", "code": 401}})
                if path.rstrip("/") in (ADAPTER_ROUTE, ADAPTER_REMOVE_ROUTE):
                    return JSONResponse(*adapter_answer(request.app.state, path, body))
                return await call_next(request)
            if kind == "read" or not beacons:
                return await call_next(request)
            if kind == "weight_info":
                now = label(beacons)
                if now.startswith("torn:"):
                    return JSONResponse(content={"weight_version": "torn", "enginehooks": now})
                return await call_next(request)
            refused = await settled_refusal(beacons, hold_s())
            if refused is not None:
                return JSONResponse(status_code=503, content={"error": dict(
                    refused, message=refused["error"], type="EngineTorn", code=503)})
            before = label(beacons)
            response = await call_next(request)
            after = label(beacons)
            response.headers["X-Enginehooks-Weight-Version"] = (
                before if before == after else f"mixed:{before}->{after}")
            if before.startswith("torn:"):
                response.headers["X-Enginehooks-Torn"] = before.removeprefix("torn:")
            return response

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        state.enginehooks_adapters = None  # an AdapterStore, made at the first upload
        state.enginehooks_beacons = []
        state.enginehooks_server_id = configured_server_id()
        if engine_client is None:
            return
        try:
            infos = await engine_client.collective_rpc("enginehooks_info")
        except Exception as e:  # the workers run without the enginehooks extension
            log.warning("enginehooks: no worker answered enginehooks_info (%s): generation is "
                        "not guarded", e)
            return
        state.enginehooks_beacons = [i["beacon"] for i in infos if i.get("beacon")]
        deployments = {i.get("deployment") for i in infos if isinstance(i, dict)}
        if state.enginehooks_server_id is None and len(deployments) == 1 and None not in deployments:
            # the id the workers share: every API process of this server reads the same
            state.enginehooks_server_id = deployments.pop()
