"""Trainer-side handles to SGLang replicas: an in-process `sglang.Engine` and an HTTP
server started with `python -m sglang.launch_server`.

Both reach the same `enginehooks_*` scheduler methods the plugin attaches; they differ
only in how the call travels:
- `SGLangEngine`: straight onto the Engine's own RPC socket (what `collective_rpc`
  uses), with a deadline and the JSON reply (see `rpc.py`).
- `SGLangServer`: `POST /enginehooks/rpc` (added by the plugin), plus SGLang's native
  `/pause_generation`, `/continue_generation` and `/flush_cache` routes. JSON only.

The prefix cache is flushed inside the scheduler right after the weights are loaded
(`enginehooks_receive`): that is the one moment the scheduler is certainly between
batches, and it happens before generation resumes. `flush_cache` here repeats it only
when that flush was refused (requests were still running: push with `pause=True`).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Any

from enginehooks.control.handles import EngineHandle
from enginehooks.control.identity import ServerIdentity
from enginehooks.core.errors import (
    ConfigError,
    EngineTorn,
    HTTPStatusError,
    PushTimeout,
    ReplicaError,
)

PAUSE_MODES = ("abort", "retract", "in_place")


class _FlushTracking(EngineHandle):
    """Remembers whether the last receive's in-scheduler flush succeeded everywhere."""

    _last_flushed: bool | None = None

    def receive(self, manifest_json: str, group: str, timeout_s: float,
                auth: str | None = None) -> list[dict[str, Any]]:
        self._last_flushed = None
        out = super().receive(manifest_json, group, timeout_s, auth)
        self._last_flushed = all(bool(w.get("flushed")) for w in out)
        return out

    def flush_pending(self) -> bool:
        return not self._last_flushed  # the receive flushed in the scheduler already

    def flush_cache(self, timeout_s: float, auth: str | None = None) -> None:
        if self._last_flushed:
            return
        results = self.flush_workers(timeout_s, auth)
        if not all(r.get("flushed") for r in results):
            raise ReplicaError(
                self.name,
                "SGLang refused to flush its prefix cache because requests are in flight; "
                "cached prefixes may hold KV computed with the old weights. Push with "
                "WeightSync(pause=True) and a pause mode of 'abort' or 'retract'.",
            )


def guard_generate(engine: Any) -> None:
    """Make the in-process `sglang.Engine.generate` raise `EngineTorn` for requests the
    scheduler refused because it is torn (SGLang answers them with an abort, status 503,
    and the reason; over HTTP that is the 503 itself)."""
    original = engine.generate
    if getattr(original, "__enginehooks_guard__", False):
        return

    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            out = original(*args, **kwargs)
        except Exception as e:  # SGLang raises HTTPException(503) for a status abort
            detail = str(getattr(e, "detail", "") or e)
            if getattr(e, "status_code", None) == 503 and "enginehooks:" in detail:
                raise EngineTorn({"error": detail[detail.index("enginehooks:"):],
                                  "state": "torn"}) from e
            raise
        for o in out if isinstance(out, list) else [out]:
            reason = (o.get("meta_info") or {}).get("finish_reason") if isinstance(o, dict) else None
            if (isinstance(reason, dict) and reason.get("type") == "abort"
                    and reason.get("status_code") == 503
                    and str(reason.get("message", "")).startswith("enginehooks:")):
                raise EngineTorn({"error": reason["message"], "state": "torn"})
        return out

    guarded.__enginehooks_guard__ = True  # type: ignore[attr-defined]
    engine.generate = guarded


def _check_mode(mode: str) -> str:
    if mode not in PAUSE_MODES:
        raise ConfigError(f"pause mode {mode!r}: SGLang knows {PAUSE_MODES}")
    return mode


class SGLangEngine(_FlushTracking):
    """An in-process `sglang.Engine` (the enginehooks plugin loads in its scheduler by
    itself: installing enginehooks in the engine's environment is enough).

    Calls go through the Engine's RPC socket with a deadline, so a hung scheduler makes
    a `PushTimeout`, not a blocked trainer. Don't call `engine.collective_rpc`
    concurrently with a push: both share that socket.

    `pause_mode`: how `pause()` stops generation around an update: "abort" (requests
    in flight end now), "retract" (they go back to the queue and are recomputed on the
    new weights), or "in_place" (they keep their KV cache; the cache cannot be flushed
    then).
    """

    def __init__(self, engine: Any, name: str = "sglang", pause_mode: str = "retract") -> None:
        from enginehooks.sglang_ext.rpc import SchedulerRpc

        self.engine = engine
        self.name = name
        self.pause_mode = _check_mode(pause_mode)
        sock = getattr(engine, "send_to_rpc", None)
        if sock is None:
            raise ReplicaError(name, "this sglang.Engine has no RPC socket (attached or "
                                     "shut down); use SGLangServer for a server")
        self._rpc = SchedulerRpc(sock, who=name)
        self._loop_lock = threading.Lock()
        guard_generate(engine)

    def rpc(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        return self._rpc.call(method, list(args), timeout_s)

    def _run(self, coro_fn: Any, timeout_s: float) -> Any:
        """Run a tokenizer-manager coroutine on the Engine's event loop, bounded.

        The Engine drives its loop with `run_until_complete` from whichever thread
        calls it; we do the same under a lock, wrapped in `wait_for` for the deadline.
        """
        if not self._loop_lock.acquire(timeout=timeout_s):
            raise PushTimeout(f"{self.name}: the engine's event loop stayed busy {timeout_s}s")
        try:
            loop = self.engine.loop
            return loop.run_until_complete(asyncio.wait_for(coro_fn(), timeout_s))
        except asyncio.TimeoutError:
            raise PushTimeout(f"{self.name}: no answer within {timeout_s}s") from None
        finally:
            self._loop_lock.release()

    def pause(self, timeout_s: float) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        tm = self.engine.tokenizer_manager
        self._run(lambda: tm.pause_generation(PauseGenerationReqInput(mode=self.pause_mode)),
                  timeout_s)

    def resume(self, timeout_s: float) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        tm = self.engine.tokenizer_manager
        self._run(lambda: tm.continue_generation(ContinueGenerationReqInput()), timeout_s)

    # SGLang's sleep mode (`--enable-memory-saver`); `level` has no SGLang equivalent:
    # everything named by the default tags is released. Untested on CPU, where SGLang's
    # release ends the engine (it calls torch.cuda.synchronize()).
    def sleep(self, level: int, timeout_s: float) -> None:
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        tm = self.engine.tokenizer_manager
        self._run(lambda: tm.release_memory_occupation(ReleaseMemoryOccupationReqInput(), None),
                  timeout_s)

    def wake_up(self, tags: list[str], timeout_s: float) -> None:
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        tm = self.engine.tokenizer_manager
        obj = ResumeMemoryOccupationReqInput(tags=list(tags))
        self._run(lambda: tm.resume_memory_occupation(obj, None), timeout_s)


class SGLangServer(_FlushTracking):
    """An SGLang HTTP server (`python -m sglang.launch_server ...`) on `url`, with
    enginehooks installed in its environment (the plugin adds `POST /enginehooks/rpc`).

    Keep the server on loopback or a private network, or start it with `--api-key` and
    pass the same `api_key` here: SGLang's key check covers the plugin's route like any
    other. With a shared secret (`secret`, a `WeightSync`'s, or `ENGINEHOOKS_SECRET`)
    every POST carries a route token: a server with the secret refuses its admin routes
    without one (`plugin.py`). Every call has a timeout.
    """

    def __init__(self, url: str = "http://127.0.0.1:30000", name: str | None = None,
                 pause_mode: str = "retract", api_key: str | None = None,
                 secret: bytes | str | None = None) -> None:
        from enginehooks.core.auth import load_secret

        self.url = url.rstrip("/")
        self.name = name or self.url
        self.pause_mode = _check_mode(pause_mode)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._secret = secret.encode() if isinstance(secret, str) else (secret or load_secret())
        # route tokens name this server (its identity, learned from it: control/identity.py)
        self._identity = ServerIdentity(self.url, self.name)

    def adopt_secret(self, secret: bytes) -> None:
        """Sign with `secret` (a `WeightSync`'s) unless this handle has its own."""
        if not self._secret:
            self._secret = secret

    def _post(self, path: str, body: Any, timeout_s: float) -> Any:
        return self._identity.post(path, body, secret=self._secret, headers=self._headers,
                                   timeout_s=timeout_s)

    def rpc(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        from enginehooks.sglang_ext.plugin import ROUTE

        body = {"method": method, "args": list(args), "timeout_s": timeout_s}
        # The route's own deadline ends first, so its answer (naming the scheduler) wins
        # over a bare HTTP timeout whenever the server process itself is alive.
        try:
            out = self._post(ROUTE, body, timeout_s + 5.0)
        except HTTPStatusError as e:
            if e.status == 404:
                raise ConfigError(
                    f"{self.name}: the SGLang server has no {ROUTE} route: the enginehooks "
                    "SGLang plugin is not loaded in it. Install enginehooks in the server's "
                    "environment and leave SGLANG_PLUGINS unset or list 'enginehooks' in "
                    "it, then restart the server") from None
            raise
        if isinstance(out, dict) and "results" in out:
            return out["results"]
        if isinstance(out, dict) and "error" in out:
            if out.get("timeout"):
                raise PushTimeout(f"{self.name}: {out['error']}")
            raise ReplicaError(self.name, str(out["error"]))
        raise ReplicaError(self.name, f"{ROUTE} answered {out!r} (is the enginehooks plugin "
                                      "loaded in the server? SGLANG_PLUGINS must allow it)")

    def pause(self, timeout_s: float) -> None:
        self._post("/pause_generation", {"mode": self.pause_mode}, timeout_s)

    def resume(self, timeout_s: float) -> None:
        self._post("/continue_generation", {}, timeout_s)

    # SGLang's sleep mode; see SGLangEngine.sleep.
    def sleep(self, level: int, timeout_s: float) -> None:
        self._post("/release_memory_occupation", {}, timeout_s)

    def wake_up(self, tags: list[str], timeout_s: float) -> None:
        self._post("/resume_memory_occupation", {"tags": list(tags)}, timeout_s)

    def generate(self, input_ids: list[int], sampling_params: dict[str, Any],
                 timeout_s: float = 60.0) -> dict[str, Any]:
        """`POST /generate` with token ids (a convenience for checks and demos)."""
        return self._post("/generate", {"input_ids": input_ids,
                                        "sampling_params": sampling_params}, timeout_s)
