"""`RayEngine`: the trainer-side handle of an engine that lives in a Ray actor."""

from __future__ import annotations

from typing import Any

from enginehooks.control.handles import EngineHandle
from enginehooks.core.errors import PushTimeout, ReplicaError
from enginehooks.ray_ext.calls import raise_reply
from enginehooks.wire.replies import WorkerInfo


class RayEngine(EngineHandle):
    """An engine replica inside Ray actor `actor`, whose class mixes in
    `enginehooks.ray_ext.EngineActorMixin` (`VLLMActor` and `SGLangActor` do).

    Every verb runs in the actor on the engine's own in-process handle (`VLLMEngine`,
    `SGLangEngine`), so it behaves exactly as it would there (native version record,
    prefix-cache flush, pause modes). Arguments and results are JSON-able. Every call
    waits through `ray.get(..., timeout=timeout_s + margin_s)`: the actor's own deadline
    (`timeout_s`) ends first when the actor is alive, so its answer names the cause;
    a hung actor gives `PushTimeout`, a dead one `ReplicaError` naming it at once.

    Ray runs one method of an actor at a time unless it was created with
    `max_concurrency`: a call stuck in the engine delays the actor's next calls too.
    """

    def __init__(self, actor: Any, name: str | None = None, margin_s: float = 10.0) -> None:
        self.actor = actor
        self.name = name or f"ray-actor-{actor._actor_id.hex()[:12]}"
        self.margin_s = margin_s

    def _call(self, op: str, *args: Any, timeout_s: float, auth: str | None = None) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayError

        try:
            ref = self.actor.enginehooks_call.remote(op, list(args), float(timeout_s), auth)
            reply = ray.get(ref, timeout=timeout_s + self.margin_s)
        except GetTimeoutError:
            raise PushTimeout(f"{self.name}: the Ray actor did not answer {op} within "
                              f"{timeout_s + self.margin_s:.0f}s") from None
        except RayActorError as e:  # died, was killed, or its node is gone
            raise ReplicaError(self.name, f"the Ray actor is dead or unreachable ({op}): "
                                          f"{type(e).__name__}: {str(e)[:500]}") from None
        except RayError as e:
            raise ReplicaError(self.name, f"{op}: {type(e).__name__}: {str(e)[:2000]}") from None
        return raise_reply(reply, self.name, op)

    # -- every verb, run on the handle inside the actor ----------------------------------
    def rpc(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        return self._call("rpc", method, *args, timeout_s=timeout_s)

    def info(self, timeout_s: float) -> list[WorkerInfo]:
        return self._call("info", timeout_s=timeout_s)

    def join(self, endpoint: dict[str, Any], rank_offset: int, timeout_s: float,
             auth: str | None = None) -> None:
        self._call("join", endpoint, rank_offset, timeout_s=timeout_s, auth=auth)

    def leave(self, timeout_s: float, auth: str | None = None) -> None:
        self._call("leave", timeout_s=timeout_s, auth=auth)

    def check(self, manifest_json: str, timeout_s: float, auth: str | None = None) -> None:
        self._call("check", manifest_json, timeout_s=timeout_s, auth=auth)

    def receive(self, manifest_json: str, group: str, timeout_s: float,
                auth: str | None = None) -> list[dict[str, Any]]:
        return self._call("receive", manifest_json, group, timeout_s=timeout_s, auth=auth)

    def flush_cache(self, timeout_s: float, auth: str | None = None) -> None:
        self._call("flush_cache", timeout_s=timeout_s, auth=auth)

    def pause(self, timeout_s: float) -> None:
        self._call("pause", timeout_s=timeout_s)

    def resume(self, timeout_s: float) -> None:
        self._call("resume", timeout_s=timeout_s)

    def version(self, timeout_s: float = 30.0) -> int | str | None:
        return self._call("version", timeout_s=timeout_s)

    def digests(self, names: list[str], timeout_s: float = 60.0) -> dict[str, Any]:
        return self._call("digests", list(names), timeout_s=timeout_s)

    def engine_version(self, timeout_s: float = 30.0) -> str:
        """The engine's own weight version (vLLM's `weight_info`), where it has one."""
        return self._call("engine_version", timeout_s=timeout_s)

    def weight_checksums(self, timeout_s: float = 120.0) -> dict[str, str]:
        """vLLM's `weight_checker` checksums of the engine in the actor."""
        return self._call("weight_checksums", timeout_s=timeout_s)
