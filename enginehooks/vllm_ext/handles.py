"""Trainer-side handles to vLLM replicas: in-process `LLM`, `AsyncLLM`, HTTP server.

All three reach the same worker extension methods (`enginehooks_*`) through vLLM's
`collective_rpc`; they differ only in how the call travels and how the engine-level
controls (prefix cache, pause) are spelled.
"""

from __future__ import annotations

import asyncio
from typing import Any

from enginehooks.control._http import request_json
from enginehooks.control.handles import EngineHandle
from enginehooks.core.errors import PushTimeout, ReplicaError
from enginehooks.vllm_ext.fail_closed import guard, guard_async


class _Beacons:
    """The workers' state files (`beacon.py`), asked for once."""

    _beacons: list[str] | None = None

    def beacons(self) -> list[str]:
        if self._beacons is None:
            self._beacons = [i["beacon"] for i in self.info(60.0) if i.get("beacon")]
        return self._beacons


class VLLMEngine(_Beacons, EngineHandle):
    """An in-process `vllm.LLM` started with
    `worker_extension_cls="enginehooks.vllm_ext.WorkerExtension"`.

    The handle guards the engine's `generate` and `chat` (`fail_closed.guard`): they
    raise `EngineTorn` while an update is applied or after one failed (policy
    "refuse"); outputs carry `enginehooks_weight_version`. After each push the
    version is recorded with vLLM's own `set_weight_version`, so every output's
    `weight_versions` says which weights produced its tokens."""

    def __init__(self, llm: Any, name: str = "vllm") -> None:
        self.llm = llm
        self.name = name
        guard(llm, self.beacons)

    def rpc(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        return self.llm.collective_rpc(method, timeout=timeout_s, args=args)

    def flush_cache(self, timeout_s: float) -> None:
        self.llm.reset_prefix_cache()

    def set_version(self, version: int | str, timeout_s: float) -> None:
        self.llm.llm_engine.set_weight_version(str(version))


class VLLMAsyncEngine(_Beacons, EngineHandle):
    """A `vllm.AsyncLLM` running on event loop `loop` (in another thread); calls are
    scheduled onto that loop and awaited here with the timeout. Its `generate` is
    guarded like `VLLMEngine`'s."""

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop, name: str = "vllm-async"):
        self.engine, self.loop, self.name = engine, loop, name
        guard_async(engine, self.beacons)

    def _run(self, coro: Any, timeout_s: float) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout=timeout_s)
        except TimeoutError:
            fut.cancel()
            raise PushTimeout(f"{self.name}: no answer within {timeout_s}s") from None

    def rpc(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        return self._run(self.engine.collective_rpc(method, timeout=timeout_s, args=args),
                         timeout_s)

    def flush_cache(self, timeout_s: float) -> None:
        self._run(self.engine.reset_prefix_cache(), timeout_s)

    def set_version(self, version: int | str, timeout_s: float) -> None:
        self._run(self.engine.update_weight_version(str(version)), timeout_s)

    def pause(self, timeout_s: float) -> None:
        self._run(self.engine.pause_generation(mode="wait"), timeout_s)

    def resume(self, timeout_s: float) -> None:
        self._run(self.engine.resume_generation(), timeout_s)


class VLLMServer(EngineHandle):
    """A vLLM OpenAI-compatible server started with `--worker-extension-cls
    enginehooks.vllm_ext.WorkerExtension` and `VLLM_SERVER_DEV_MODE=1` (which enables
    `/collective_rpc`, `/pause`, `/resume`, `/reset_prefix_cache`). Keep such a server
    on loopback or a private network: dev-mode routes are not authenticated."""

    def __init__(self, url: str, name: str | None = None, pause_mode: str = "wait",
                 api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.name = name or self.url
        self.pause_mode = pause_mode
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _post(self, path: str, body: Any | None, timeout_s: float) -> Any:
        return request_json(f"{self.url}{path}", body if body is not None else {},
                            timeout_s=timeout_s, who=self.name, headers=self._headers)

    def rpc(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        body = {"method": method, "args": [str(a) for a in args], "timeout": timeout_s}
        out = self._post("/collective_rpc", body, timeout_s + 5.0)
        if not isinstance(out, dict) or "results" not in out:
            raise ReplicaError(self.name, f"/collective_rpc answered {out!r}")
        return out["results"]

    def flush_cache(self, timeout_s: float) -> None:
        self._post("/reset_prefix_cache", None, timeout_s)

    def set_version(self, version: int | str, timeout_s: float) -> None:
        self._post("/update_weight_version", {"new_version": str(version)}, timeout_s)

    def pause(self, timeout_s: float) -> None:
        self._post(f"/pause?mode={self.pause_mode}", None, timeout_s)

    def resume(self, timeout_s: float) -> None:
        self._post("/resume", None, timeout_s)
