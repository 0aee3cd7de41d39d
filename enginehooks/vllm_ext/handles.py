"""Trainer-side handles to vLLM replicas: in-process `LLM`, `AsyncLLM`, HTTP server.

Two mechanisms, each used for what it does best:

- **the worker extension** (`enginehooks_*` methods, reached through vLLM's
  `collective_rpc`) for what only code inside the workers can do: say what the workers
  run (dtype, count, version, torn state), check a manifest and return the problems,
  join a group with per-worker ranks, receive and apply an update, crc32 digests;
- **vLLM's native controls** wherever vLLM has one: pause and resume with vLLM's modes
  (`abort`, `wait`, `keep`), the engine's weight version (`update_weight_version`, which
  vLLM stamps on every output and shows in `/weight_info`), prefix-cache reset, and the
  `weight_checker` checksums (sha256 of every weight as the kernels hold it).

After an update a handle records its version as vLLM's weight version; after a failed
one it records `TORN` there, so outputs are never stamped with a version whose weights
the engine does not hold (the next successful push replaces it).

What an update makes stale, from what vLLM 0.32 caches (read in its source), and what
`flush_cache` (the push's finish, while still paused) does about it:
- the prefix cache (KV blocks computed by the old weights): reset (`reset_prefix_cache`);
- the encoder cache (a multimodal model's encoder outputs, vision embeddings, kept by
  the scheduler's `EncoderCacheManager` and the model runner's `encoder_cache`, keyed by
  the input's hash only): reset (`reset_encoder_cache`, which clears both), else the
  same image after a push is answered with the old tower's embeddings;
- the multimodal processor caches (the front end's processor cache, the worker's
  receiver cache): they hold the HF processor's outputs (pixel values, token
  placements), computed from the inputs and the processor's config, never from the
  weights, so they stay valid and are not reset (a reset while requests are in flight
  can desynchronise the sender and receiver caches: vLLM's own warning).

`VLLMEngine` and `VLLMServer` also implement vLLM's own `VLLMWeightSyncClient`
protocol (`init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
`finish_weight_update`, plus `shutdown_weight_transfer_engine`,
`reset_prefix_cache`, `update_weight_version`), so they can drive any vLLM
weight-transfer backend from vLLM's trainer-side engines, the "enginehooks" one
included (`enginehooks.vllm_ext.transfer_trainer`): JSON bodies, a timeout on every
call, and the server's error text kept in the exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse
from collections.abc import Callable
from typing import Any

from enginehooks.control._futures import spawn
from enginehooks.control._http import request_json
from enginehooks.control.handles import EngineHandle
from enginehooks.control.identity import ServerIdentity
from enginehooks.core.auth import load_secret
from enginehooks.core.deadline import Deadline
from enginehooks.core.errors import (
    ConfigError,
    EngineHooksError,
    HTTPStatusError,
    PushTimeout,
    ReplicaError,
)
from enginehooks.engine.contract import PREFIX
from enginehooks.vllm_ext.fail_closed import (
    ADAPTER_REMOVE_ROUTE,
    ADAPTER_ROUTE,
    guard,
    guard_async,
)
from enginehooks.wire.adapters import AdapterUpload, served_name

#: vLLM's runtime adapter loader (with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING)
LOAD_LORA_ROUTE = "/v1/load_lora_adapter"

#: vLLM's weight version after a failed update (the engine holds a mix of versions).
TORN = "torn"
#: How vLLM's `pause` treats requests in flight: end them now, let them finish first,
#: or freeze them in the queue until `resume`.
PAUSE_MODES = ("abort", "wait", "keep")


def _check_mode(mode: str) -> str:
    if mode not in PAUSE_MODES:
        raise ConfigError(f"pause mode {mode!r}: vLLM knows {PAUSE_MODES}")
    return mode


def merge_checksums(per_worker: list[dict[str, str]]) -> dict[str, str]:
    """One `{worker-prefixed weight name: sha256}` mapping from vLLM's per-worker
    checksums (names are prefixed `dp0:pp0:pcp0:tp0:`, so workers never collide)."""
    out: dict[str, str] = {}
    for worker in per_worker:
        out.update(worker)
    return out


def checksum_mismatches(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """Weight names whose checksums differ between two replicas (or exist in one only):
    empty when both hold bit-identical weights."""
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


SETUP_HINT = ("the vLLM workers have no enginehooks methods: start vLLM with "
              "--worker-extension-cls enginehooks.vllm_ext.WorkerExtension (and, for a "
              "server, VLLM_SERVER_DEV_MODE=1)")


def worker_failure(e: BaseException) -> list[Any]:
    """A worker failure vLLM handed to this call. Our verbs answer envelopes and never
    fail in vLLM's sense, so it is either a setup error (no worker extension: raised,
    saying the fix) or the late failure of another client's call (returned as a stale
    answer, which the caller reads past)."""
    text = str(e)
    if f"has no attribute '{PREFIX}" in text:
        raise ConfigError(f"{SETUP_HINT} ({text[:300]})") from None
    if "Worker failed with error" in text or "Worker failed" in text:
        return [None]
    raise e



def _prefix_cache_reset(name: str, reset: Callable[[], Any], preempting: Callable[[], Any]
                        ) -> None:
    """Drop every prefix-cache block computed with the old weights, or fail the push.

    vLLM resets its prefix cache only while no request holds a block: with requests in
    flight (a push without `pause`, or `pause_mode="keep"`, whose frozen requests keep
    their blocks) `reset_prefix_cache` answers False and drops nothing, so every later
    request sharing a cached prefix (a system prompt) would reuse KV computed by the
    old weights while the engine reports the new version. Then the reset is asked again
    with `reset_running_requests`: vLLM preempts the requests in flight, which are
    recomputed with the new weights (as a fresh engine would compute them). If even
    that fails (vLLM: requests waiting for a remote KV transfer), the push fails here,
    naming the fix, rather than report a flush that did not happen."""
    if reset() is not False:
        return
    try:
        ok = preempting()
    except Exception as e:  # vLLM raises where preempting cannot free every block
        raise ReplicaError(name, f"the prefix cache could not be reset after the update "
                                 f"({type(e).__name__}: {e}); old-weight prefixes would be "
                                 f"reused: let requests in flight finish (pause with "
                                 f"mode 'wait' or 'abort') and push again") from None
    if ok is False:
        raise ReplicaError(name, "the prefix cache could not be reset after the update, even "
                                 "preempting the requests in flight; old-weight prefixes "
                                 "would be reused: let requests in flight finish (pause "
                                 "with mode 'wait' or 'abort') and push again")

class _VLLMHandle(EngineHandle):
    """What every vLLM handle adds to the contract: the engine's own weight version.

    vLLM's `collective_rpc` keeps the answer of a call that timed out in its worker
    queue and hands it to the next caller; so no handle gives vLLM a deadline (each
    bounds its own wait instead), and every call carries a call id that the workers
    echo (`EngineHandle.call`), so a late answer is never taken for this call's."""

    timeout_s: float = 120.0

    def _tagged_rpc(self, method: str, *args: Any, deadline: Deadline) -> list[Any]:
        try:
            return super()._tagged_rpc(method, *args, deadline=deadline)
        except (EngineHooksError, RuntimeError) as e:
            if isinstance(e, PushTimeout):
                raise
            return worker_failure(e)

    def set_engine_version(self, version: str, timeout_s: float) -> None:
        """Record `version` as vLLM's weight version (outputs carry it)."""
        raise NotImplementedError

    def engine_version(self, timeout_s: float = 30.0) -> str:
        """vLLM's weight version, as its `weight_info` reports it."""
        raise NotImplementedError

    def weight_checksums(self, timeout_s: float = 120.0) -> dict[str, str]:
        """vLLM's `weight_checker` checksums: sha256 of every weight, per worker."""
        raise NotImplementedError

    _updates = 0  # receives started through this handle: a late torn mark yields

    _beacons: list[str] | None = None

    def beacons(self) -> list[str]:
        """The workers' state files (`engine/beacon.py`), asked for once: what the fail-closed
        guards read."""
        if self._beacons is None:
            self._beacons = [i["beacon"] for i in self.info(60.0) if i.get("beacon")]
        return self._beacons

    def receive(self, manifest_json: str, group: str, timeout_s: float,
                auth: str | None = None) -> list[dict[str, Any]]:
        self._updates += 1
        update = self._updates
        try:
            out = super().receive(manifest_json, group, timeout_s, auth)
        except BaseException:
            # Fire and forget: the failure must reach the coordinator now, not after a
            # call to an engine that may be the one that stopped answering.
            spawn(self._mark_torn, update, timeout_s, name=f"enginehooks-torn-{self.name}")
            raise
        versions = {str(w.get("version")) for w in out}
        if len(versions) == 1:
            self.set_engine_version(versions.pop(), timeout_s)
        return out

    def _mark_torn(self, update: int, timeout_s: float) -> None:
        if update != self._updates:  # a later update already began: it decides
            return
        with contextlib.suppress(Exception):  # best effort: the push failed and says why
            self.set_engine_version(TORN, timeout_s)


class VLLMEngine(_VLLMHandle):
    """An in-process `vllm.LLM` started with
    `worker_extension_cls="enginehooks.vllm_ext.WorkerExtension"` (for `WeightSync`), or
    with `weight_transfer_config={"backend": "enginehooks"}` (for vLLM's trainer-side
    engines, with this handle as their client), or both.

    An offline `LLM` has no pause: it generates only when its caller asks. The handle
    guards the engine's `generate` and `chat` (`fail_closed.guard`): they raise
    `EngineTorn` while an update is applied or after one failed (policy "refuse"), and
    outputs carry `enginehooks_weight_version`."""

    def __init__(self, llm: Any, name: str = "vllm", timeout_s: float = 120.0) -> None:
        self.llm = llm
        self.name = name
        self.timeout_s = timeout_s
        guard(llm, self.beacons)

    def rpc(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        # No vLLM deadline (see _VLLMHandle): `WeightSync` bounds the wait.
        return self.llm.collective_rpc(method, args=args)

    def flush_cache(self, timeout_s: float, auth: str | None = None) -> None:
        _prefix_cache_reset(self.name, self.llm.reset_prefix_cache,
                            lambda: self.llm.reset_prefix_cache(reset_running_requests=True))
        self.reset_encoder_cache()

    def sleep(self, level: int, timeout_s: float) -> None:
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str], timeout_s: float) -> None:
        self.llm.wake_up(tags=list(tags))

    def is_sleeping(self, timeout_s: float) -> bool | None:
        return bool(self.llm.llm_engine.is_sleeping())

    def set_engine_version(self, version: str, timeout_s: float) -> None:
        self.llm.update_weight_version(version)

    def engine_version(self, timeout_s: float = 30.0) -> str:
        return self.llm.get_weight_version()

    def weight_checksums(self, timeout_s: float = 120.0) -> dict[str, str]:
        return merge_checksums(self.llm.collective_rpc("compute_weight_checksums",
                                                       timeout=timeout_s))

    # -- vLLM's VLLMWeightSyncClient protocol, and the extras vLLM's LLM has -----------
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def reset_encoder_cache(self) -> None:
        """Drop cached encoder outputs (vision embeddings of the old weights)."""
        self.llm.llm_engine.reset_encoder_cache()

    def update_weight_version(self, new_version: str) -> None:
        self.llm.update_weight_version(new_version)


class VLLMAsyncEngine(_VLLMHandle):
    """A `vllm.AsyncLLM` running on event loop `loop` (in another thread); calls are
    scheduled onto that loop and awaited here with the timeout. `pause_mode` is vLLM's
    (`abort`, `wait`, `keep`). Its `generate` is guarded like `VLLMEngine`'s."""

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop, name: str = "vllm-async",
                 pause_mode: str = "wait") -> None:
        self.engine, self.loop, self.name = engine, loop, name
        self.pause_mode = _check_mode(pause_mode)
        guard_async(engine, self._beacons_on_loop)

    async def _beacons_on_loop(self) -> list[str]:
        if self._beacons is None:
            infos = await self.engine.collective_rpc("enginehooks_info")
            self._beacons = [i["beacon"] for i in infos if i.get("beacon")]
        return self._beacons

    def _run(self, coro: Any, timeout_s: float) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout=timeout_s)
        except TimeoutError:
            fut.cancel()
            raise PushTimeout(f"{self.name}: no answer within {timeout_s}s") from None

    def rpc(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        # No vLLM deadline (see _VLLMHandle): this wait is bounded instead.
        return self._run(self.engine.collective_rpc(method, args=args), timeout_s)

    def flush_cache(self, timeout_s: float, auth: str | None = None) -> None:
        _prefix_cache_reset(
            self.name, lambda: self._run(self.engine.reset_prefix_cache(), timeout_s),
            lambda: self._run(self.engine.reset_prefix_cache(reset_running_requests=True),
                              timeout_s))
        self._run(self.engine.reset_encoder_cache(), timeout_s)

    def pause(self, timeout_s: float) -> None:
        self._run(self.engine.pause_generation(mode=self.pause_mode), timeout_s)

    def resume(self, timeout_s: float) -> None:
        self._run(self.engine.resume_generation(), timeout_s)

    def sleep(self, level: int, timeout_s: float) -> None:
        self._run(self.engine.sleep(level), timeout_s)

    def wake_up(self, tags: list[str], timeout_s: float) -> None:
        self._run(self.engine.wake_up(list(tags)), timeout_s)

    def is_sleeping(self, timeout_s: float) -> bool | None:
        return bool(self._run(self.engine.is_sleeping(), timeout_s))

    def set_engine_version(self, version: str, timeout_s: float) -> None:
        self._run(self.engine.update_weight_version(version), timeout_s)

    def engine_version(self, timeout_s: float = 30.0) -> str:
        return self._run(self.engine.get_weight_version(), timeout_s)

    def weight_checksums(self, timeout_s: float = 120.0) -> dict[str, str]:
        return merge_checksums(self._run(self.engine.compute_weight_checksums(), timeout_s))


class VLLMServer(_VLLMHandle):
    """A vLLM OpenAI-compatible server in dev mode (`VLLM_SERVER_DEV_MODE=1`, which
    enables `/collective_rpc` and vLLM's RL routes `/pause`, `/resume`,
    `/update_weight_version`, `/weight_info`, `/weight_checker`, ...), started with
    `--worker-extension-cls enginehooks.vllm_ext.WorkerExtension` for `WeightSync`, or
    `--weight-transfer-config '{"backend": "enginehooks"}'` for vLLM's trainer-side
    engines (this handle is then their client), or both. Keep such a server on
    loopback or a private network, or behind `--api-key` (pass the same `api_key`):
    dev-mode routes are otherwise unauthenticated.

    `pause_mode`: how `pause()` treats requests in flight (vLLM's `abort`, `wait`,
    `keep`). `timeout_s`: the deadline of the client-protocol calls, which take none.
    """

    def __init__(self, url: str, name: str | None = None, pause_mode: str = "wait",
                 api_key: str | None = None, timeout_s: float = 120.0,
                 secret: bytes | str | None = None) -> None:
        self.url = url.rstrip("/")
        self.name = name or self.url
        self.pause_mode = _check_mode(pause_mode)
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Signs the control routes, which an engine with a secret guards (fail_closed.py),
        # for this server only (its identity, learned from the server: control/identity.py)
        self._secret = secret.encode() if isinstance(secret, str) else (secret or load_secret())
        self._identity = ServerIdentity(self.url, self.name)

    def adopt_secret(self, secret: bytes) -> None:
        """Sign with `secret` (a `WeightSync`'s) unless this handle has its own."""
        if not self._secret:
            self._secret = secret

    def _post(self, path: str, body: Any | None, timeout_s: float) -> Any:
        body = body if body is not None else {}
        try:
            return self._identity.post(path, body, secret=self._secret, headers=self._headers,
                                       timeout_s=timeout_s)
        except HTTPStatusError as e:
            if e.status != 404:
                raise
            # vLLM registers its control routes (RL, weight transfer, collective_rpc)
            # only in dev mode: a bare 404 would hide the one setting to change.
            route = path.split("?", 1)[0]
            extra = f" ({SETUP_HINT})" if route == "/collective_rpc" else ""
            raise ConfigError(f"{self.name}: the server has no {route} route: start vLLM "
                              f"with VLLM_SERVER_DEV_MODE=1, which enables its control "
                              f"routes{extra}") from None

    def _get(self, path: str, timeout_s: float) -> Any:
        return request_json(f"{self.url}{path}", None, timeout_s=timeout_s, who=self.name,
                            headers=self._headers)

    def rpc(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        # No "timeout" for vLLM: one that expires leaves its answer queued for the next
        # call (see _VLLMHandle); this client bounds its own wait.
        body = {"method": method, "args": [str(a) for a in args]}
        out = self._post("/collective_rpc", body, timeout_s)  # a 404 says: dev mode
        if not isinstance(out, dict) or "results" not in out:
            raise ReplicaError(self.name, f"/collective_rpc answered {out!r}")
        return out["results"]

    def flush_cache(self, timeout_s: float, auth: str | None = None) -> None:
        def reset(path: str) -> bool:
            out = self._post(path, None, timeout_s)
            return not isinstance(out, dict) or out.get("success") is not False

        _prefix_cache_reset(self.name, lambda: reset("/reset_prefix_cache"),
                            lambda: reset("/reset_prefix_cache?reset_running_requests=true"))
        self.reset_encoder_cache(timeout_s)

    def pause(self, timeout_s: float) -> None:
        self._post(f"/pause?mode={self.pause_mode}", None, timeout_s)

    def resume(self, timeout_s: float) -> None:
        self._post("/resume", None, timeout_s)

    def is_paused(self, timeout_s: float = 30.0) -> bool:
        return bool(self._get("/is_paused", timeout_s)["is_paused"])

    def sleep(self, level: int, timeout_s: float) -> None:
        self._post(f"/sleep?level={int(level)}", None, timeout_s)

    def wake_up(self, tags: list[str], timeout_s: float) -> None:
        query = "&".join(f"tags={urllib.parse.quote(t)}" for t in tags)
        self._post(f"/wake_up?{query}", None, timeout_s)

    def is_sleeping(self, timeout_s: float) -> bool | None:
        return bool(self._get("/is_sleeping", timeout_s)["is_sleeping"])

    def set_engine_version(self, version: str, timeout_s: float) -> None:
        self._post("/update_weight_version", {"new_version": version}, timeout_s)

    def engine_version(self, timeout_s: float = 30.0) -> str:
        return str(self._get("/weight_info", timeout_s)["weight_version"])

    def weight_checksums(self, timeout_s: float = 120.0) -> dict[str, str]:
        out = self._post("/weight_checker", {"action": "checksum"}, timeout_s)
        return dict(out["checksums"])

    def compare_checksums(self, baseline: dict[str, str], timeout_s: float = 120.0) -> list[str]:
        """Weight names whose checksums differ from `baseline` (vLLM compares)."""
        out = self._post("/weight_checker", {"action": "compare", "baseline": baseline},
                         timeout_s)
        return list(out["mismatches"])

    # -- LoRA adapters: our upload route, then vLLM's own loader ------------------------
    def load_adapter(self, upload: AdapterUpload, timeout_s: float) -> str:
        served = served_name(upload.name, upload.version)
        stored = self._post(ADAPTER_ROUTE, upload.body(), timeout_s)
        try:
            self._identity.post(LOAD_LORA_ROUTE, {"lora_name": served, "lora_path": stored["path"]},
                                secret=self._secret, headers=self._headers, timeout_s=timeout_s)
        except HTTPStatusError as e:
            with contextlib.suppress(EngineHooksError):
                self._post(ADAPTER_REMOVE_ROUTE, {"name": upload.name, "version": upload.version},
                           timeout_s)
            if e.status == 404:
                raise ConfigError(f"{self.name}: the server loads no LoRA adapter at runtime: "
                                  "start vLLM with --enable-lora (and --max-lora-rank at least "
                                  "the adapter's r) and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
                                  ) from None
            raise ConfigError(f"{self.name}: vLLM refused adapter {served} (nothing changed): "
                              f"{e}") from None
        return served

    def unload_adapter(self, name: str, version: str, timeout_s: float) -> None:
        self._identity.post("/v1/unload_lora_adapter", {"lora_name": served_name(name, version)},
                            secret=self._secret, headers=self._headers, timeout_s=timeout_s)
        self._post(ADAPTER_REMOVE_ROUTE, {"name": name, "version": version}, timeout_s)

    # -- vLLM's VLLMWeightSyncClient protocol, over vLLM's RL routes -------------------
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": init_info}, self.timeout_s)

    def start_weight_update(self) -> None:
        self._post("/start_weight_update", None, self.timeout_s)

    def start_draft_weight_update(self) -> None:
        """Like `start_weight_update`, for the server's speculative draft model."""
        self._post("/start_draft_weight_update", None, self.timeout_s)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._post("/update_weights", {"update_info": update_info}, self.timeout_s)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = {"weight_version": weight_version} if weight_version is not None else None
        self._post("/finish_weight_update", body, self.timeout_s)

    def shutdown_weight_transfer_engine(self) -> None:
        self._post("/shutdown_weight_transfer_engine", None, self.timeout_s)

    def reset_prefix_cache(self) -> None:
        self._post("/reset_prefix_cache", None, self.timeout_s)

    def reset_encoder_cache(self, timeout_s: float | None = None) -> None:
        """Drop cached encoder outputs (vision embeddings of the old weights)."""
        self._post("/reset_encoder_cache", None, timeout_s or self.timeout_s)

    def update_weight_version(self, new_version: str) -> None:
        self.set_engine_version(new_version, self.timeout_s)
