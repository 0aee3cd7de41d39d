"""The SGLang plugin: `register()` is the `sglang.srt.plugins` entry point.

SGLang calls `register()` (no arguments) in every one of its processes (the Engine or
HTTP main process, each scheduler, the detokenizer) and then applies the hooks that
were registered. So it must be cheap and idempotent: it only registers hooks, imports
nothing heavy, and does it once per process.

Hooks (all through SGLang's `HookRegistry`):
- AFTER `Scheduler.__init__`: attach the `enginehooks_*` methods (see `scheduler.py`)
  to the scheduler, so `collective_rpc` reaches them.
- AFTER `Scheduler.handle_rpc_request`: put our methods' JSON reply into the
  `RpcReqOutput.message` (SGLang drops RPC return values otherwise).
- AROUND `Scheduler.handle_generate_request`: fail closed. While an update failed after
  data moved (policy "refuse"), every new request is finished at once with SGLang's own
  abort path, HTTP status 503 and a message naming the version and the reason.
- BEFORE `http_server._setup_and_run_http_server` (HTTP server only): add the route
  `POST /enginehooks/rpc` and bind the scheduler's RPC socket for it. `launch_server`
  offers no route to scheduler methods; an in-process `Engine` binds that socket
  itself and never runs this hook. With a shared secret in the server's environment,
  also guard every route SGLang itself marks as an admin route (`@auth_level`
  ADMIN_OPTIONAL / ADMIN_FORCE: `/update_weights_from_disk`,
  `/update_weights_from_distributed`, `/init_weights_update_group`,
  `/release_memory_occupation`, `/pause_generation`, ...): each needs a token
  signed with the secret (`X-Enginehooks-Auth`, sent by `SGLangServer`), or is
  refused with HTTP 401 (`OPEN_ADMIN_ROUTES` says which stay open, and why). Without
  `--api-key`/`--admin-api-key` SGLang serves those routes to anyone, and they change
  the weights behind the trainer's back. A secret
  that cannot be loaded, or a guard that cannot be installed, stops the server
  instead of serving it unguarded.

Why a route rather than `--custom-weight-loader` + `/update_weights_from_tensor` for
servers: the loader route only moves tensors inlined into the HTTP body as base64
pickles, answers nothing but success/message, and cannot join a gloo/NCCL group or
validate a manifest before data moves. The route gives a server exactly the RPC surface
an in-process Engine has (join, check, receive from any transport, digests, info), with
JSON replies; its cost is that it relies on two private SGLang names, checked at
registration time so a version that renames them fails loudly, not silently.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from enginehooks.core.errors import ConfigError
from enginehooks.engine.contract import PREFIX, verb_of

log = logging.getLogger("enginehooks.sglang")

ROUTE = "/enginehooks/rpc"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_HTTP_SETUP = "sglang.srt.entrypoints.http_server._setup_and_run_http_server"

_registered = False
_lock = threading.Lock()


def register() -> None:
    """Entry point of `sglang.srt.plugins` (name `enginehooks`; `SGLANG_PLUGINS` filters
    by that name). Registers hooks once per process; later calls are no-ops."""
    global _registered
    with _lock:
        if _registered:
            return
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(f"{_SCHEDULER}.__init__", _after_scheduler_init, HookType.AFTER)
        HookRegistry.register(f"{_SCHEDULER}.handle_rpc_request", _after_handle_rpc,
                              HookType.AFTER)
        HookRegistry.register(_HTTP_SETUP, _before_http_server, HookType.BEFORE)
        HookRegistry.register(f"{_SCHEDULER}.handle_generate_request", _around_generate,
                              HookType.AROUND)
        _registered = True


def _after_scheduler_init(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    from enginehooks.sglang_ext.scheduler import attach

    attach(self)
    return None


def _around_generate(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    from enginehooks.sglang_ext.scheduler import refuse_if_torn

    return refuse_if_torn(original, self, *args, **kwargs)


def _after_handle_rpc(result: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    from enginehooks.sglang_ext.scheduler import reply_message

    recv_req = args[0] if args else kwargs.get("recv_req")
    try:
        message = reply_message(self, recv_req)
    except Exception as e:  # never turn a reply into a scheduler crash
        log.exception("enginehooks: could not build the RPC reply")
        if result is not None and getattr(recv_req, "method", "").startswith(PREFIX):
            result.success, result.message = False, f"enginehooks reply failed: {e}"
        return result
    if message is not None and result is not None:
        result.message = message
    return result


def _before_http_server(*args: Any, **kwargs: Any) -> None:
    """Add `POST /enginehooks/rpc` to SGLang's FastAPI app before uvicorn starts, and,
    with a shared secret, the guard of the admin routes (never skipped: a server with a
    secret is not served unguarded)."""
    from enginehooks.core.auth import load_secret

    secret = load_secret()  # a secret file that cannot be read stops the server here
    if secret:
        from sglang.srt.entrypoints.http_server import app

        install_admin_guard(app, secret)
    try:
        port_args = kwargs["port_args"] if "port_args" in kwargs else args[3]
        server_args = kwargs["server_args"] if "server_args" in kwargs else args[0]
        install_route(port_args.rpc_ipc_name, server_args)
    except Exception:
        # The server must still come up; our route will be missing and the handle says so.
        log.exception("enginehooks: could not add %s to the SGLang server", ROUTE)
    return None


def install_route(rpc_ipc_name: str, server_args: Any) -> None:
    import asyncio

    import zmq
    from fastapi import Body
    from sglang.srt.entrypoints.http_server import app
    from sglang.srt.utils.auth import AuthLevel, auth_level

    from enginehooks.sglang_ext.rpc import RpcTimeout, SchedulerRpc

    if any(getattr(r, "path", None) == ROUTE for r in app.routes):
        return
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(rpc_ipc_name)
    client = SchedulerRpc(sock, who=f"sglang server :{getattr(server_args, 'port', '?')}")

    def call(method: str, args: list[Any], timeout_s: float) -> dict[str, Any]:
        try:
            return {"results": client.call(method, args, timeout_s)}
        except RpcTimeout as e:
            return {"error": str(e), "timeout": True}
        except Exception as e:
            return {"error": str(e), "timeout": False}

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def enginehooks_rpc(body: dict = Body(...)) -> dict[str, Any]:
        """Run an `enginehooks_*` scheduler method; JSON in, JSON out."""
        method = str(body.get("method", ""))
        try:
            verb_of(method)
        except ConfigError as e:
            return {"error": f"{ROUTE}: {e}", "timeout": False}
        args = body.get("args") or []
        if not isinstance(args, list):
            return {"error": "args must be a JSON list", "timeout": False}
        timeout_s = min(float(body.get("timeout_s", 60.0)), 3600.0)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, call, method, args, timeout_s)

    app.add_api_route(ROUTE, enginehooks_rpc, methods=["POST"])
    log.info("enginehooks: %s ready (scheduler RPC socket %s)", ROUTE, rpc_ipc_name)


#: Admin routes left open with a secret, and why: none changes the weights or what an
#: answer is labelled with.
OPEN_ADMIN_ROUTES: dict[str, str] = {
    "/freeze_gc": "SGLang calls it on itself after warm-up, without any token",
    "/flush_cache": "drops cached prefixes only (recomputed on the next request); tools "
                    "flush before reading the engine",
    ROUTE: "every verb that changes the engine carries its own token (engine/side.py); "
           "info and digests read only",
}


def install_admin_guard(app: Any, secret: bytes) -> None:
    """Refuse every request to a route SGLang marks as an admin route (its own
    `@auth_level` metadata: the engine that owns the routes says which ones change it)
    that carries no valid enginehooks route token (`wire/`: signed over
    method, host, path, query and body, fresh, used once). See the module docstring.

    A plain ASGI middleware: SGLang replaces FastAPI's `@app.middleware("http")` with
    one that ignores the response a middleware returns and hands the original `receive`
    on, so a refusal must be sent here and a body read here must be replayed."""
    if getattr(app.state, "enginehooks_admin_guard", False):
        return
    app.add_middleware(AdminGuard, secret=secret)
    app.state.enginehooks_admin_guard = True
    log.info("enginehooks: SGLang admin routes need a token signed with the shared secret")


class AdminGuard:
    """The ASGI middleware of `install_admin_guard`."""

    def __init__(self, app: Any, secret: bytes) -> None:
        import uuid

        from enginehooks.core.auth import configured_server_id
        from enginehooks.wire import server_verifier

        self.app = app
        self.secret = secret
        #: this server's identity, fixed at start: the audience its route tokens name
        #: (SGLang serves HTTP from one process, so one drawn here is the server's)
        self.server = configured_server_id() or f"sglang-{uuid.uuid4().hex}"
        self.verifier = server_verifier(secret, self.server)

    def _admin(self, scope: dict[str, Any]) -> bool:
        from sglang.srt.utils.auth import AuthLevel
        from starlette.routing import Match

        router = scope.get("app")
        routes = getattr(getattr(router, "router", None), "routes", None) or []
        for route in routes:
            try:
                match, child = route.matches(scope)
            except Exception:
                continue
            if match == Match.FULL:
                endpoint = child.get("endpoint") or getattr(route, "endpoint", None)
                level = getattr(endpoint, "_auth_level", AuthLevel.NORMAL)
                return level != AuthLevel.NORMAL
        return False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        from enginehooks.wire import IDENTITY_ROUTE

        if scope.get("type") == "http" and path.rstrip("/") == IDENTITY_ROUTE:
            await self._identity(scope, receive, send)
            return
        if (scope.get("type") != "http" or scope.get("method") == "OPTIONS"
                or path.rstrip("/") in OPEN_ADMIN_ROUTES or not self._admin(scope)):
            await self.app(scope, receive, send)
            return
        from starlette.requests import Request
        from starlette.responses import JSONResponse

        from enginehooks.core.auth import AuthError
        from enginehooks.wire import ROUTE_AUTH_HEADER, verify_route

        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            more = bool(message.get("more_body"))
        body = b"".join(chunks)
        request = Request(scope)
        try:
            verify_route(self.verifier, request.method, path, request.url.query, body,
                         request.headers.get(ROUTE_AUTH_HEADER))
        except AuthError as e:
            await JSONResponse(status_code=401, content={"error": (
                f"enginehooks: {path} is an admin route and this engine has a shared "
                f"secret: {e} (enginehooks' SGLangServer signs its calls)")})(
                scope, receive, send)
            return
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _identity(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Answer `IDENTITY_ROUTE`: this server's identity, signed over the client's nonce."""
        from starlette.requests import Request
        from starlette.responses import JSONResponse

        from enginehooks.wire import identity_answer

        nonce = Request(scope).query_params.get("nonce", "")
        await JSONResponse(content=identity_answer(self.secret, self.server, nonce))(
            scope, receive, send)
