"""Fail closed on vLLM: no generation from weights the engine does not fully hold.

While a worker is applying an update, or after an update failed after data moved
("torn"), vLLM's front ends refuse generation under the policy `on_torn="refuse"`
(the default) with an error naming the version and the reason; under "serve" they
serve and mark the answers. Each front end reads the workers' published state
(`engine/beacon.py`):

- the API server: an endpoint plugin (`EnginehooksEndpoints`, entry point
  `vllm.endpoint_plugins`; vLLM loads endpoint plugins only when they are named in
  `VLLM_PLUGINS`, so start servers with `VLLM_PLUGINS=enginehooks`) adds a middleware:
  a generation request that arrives while an update is applied is held until the
  update ends (at most `ENGINEHOOKS_HOLD_S`, default 60 s) and then served by the new
  weights, or refused if the update left the engine torn; generation requests get
  HTTP 503 with a JSON body while refused; every generation
  response carries `X-Enginehooks-Weight-Version` (or `mixed:a->b` when an update
  landed while it ran) and, when served torn, `X-Enginehooks-Torn`;
- in-process `vllm.LLM` / `AsyncLLM`: the handles (`VLLMEngine`, `VLLMAsyncEngine`)
  guard the engine's `generate` / `chat`, which raise `EngineTorn`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from argparse import Namespace
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from enginehooks.core.errors import EngineTorn
from enginehooks.engine.beacon import Beacon
from enginehooks.engine.side import refusal_of

log = logging.getLogger("enginehooks.vllm")

#: Routes that generate tokens (prefix match).
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/generate",
                    "/inference/", "/v1/embeddings")


def states(beacons: Sequence[str]) -> list[dict[str, Any]]:
    return [s for s in (Beacon.read(b) for b in beacons) if s is not None]


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
        return "torn:" + ",".join(sorted({str(s.get("failed_version")) for s in ss}))
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
class EnginehooksEndpoints:
    """vLLM endpoint plugin (`vllm.endpoint_plugins`, name `enginehooks`): the fail-closed
    middleware of the API server (see the module docstring)."""

    name = "enginehooks"
    required_tasks = None

    def attach_router(self, app: Any) -> None:
        from fastapi.responses import JSONResponse

        @app.middleware("http")
        async def enginehooks_fail_closed(request: Any, call_next: Any) -> Any:
            path = request.url.path
            beacons: Sequence[str] = getattr(request.app.state, "enginehooks_beacons", ())
            if request.method != "POST" or not beacons or not path.startswith(GENERATION_PATHS):
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
        state.enginehooks_beacons = []
        if engine_client is None:
            return
        try:
            infos = await engine_client.collective_rpc("enginehooks_info")
        except Exception as e:  # the workers run without the enginehooks extension
            log.warning("enginehooks: no worker answered enginehooks_info (%s): generation is "
                        "not guarded", e)
            return
        state.enginehooks_beacons = [i["beacon"] for i in infos if i.get("beacon")]
