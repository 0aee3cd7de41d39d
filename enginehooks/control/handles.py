"""Engine handles: the control plane between a `WeightSync` and one engine replica.

A handle turns the verbs of the engine contract (`enginehooks.engine.contract`) into
the engine's own RPC mechanism (vLLM `collective_rpc`, its HTTP route, SGLang's
scheduler RPC). Every call takes a timeout, and takes and returns JSON-able values.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any

from enginehooks import wire
from enginehooks.core.deadline import Deadline
from enginehooks.core.errors import ConfigError, ManifestError, ReplicaError
from enginehooks.engine.contract import INFO, method_name
from enginehooks.wire.adapters import AdapterUpload


class EngineHandle(ABC):
    """One engine replica, as seen from the trainer. Subclasses implement `rpc` and the
    engine-level controls; the update verbs are shared."""

    #: label used in reports and errors
    name: str = "engine"
    #: whether `receive` hands its manifest argument to the workers' contract verb as
    #: it is, so that a push on a prepared layout (`core/layout.py`) can send a
    #: reference instead; a handle that translates the manifest into another protocol
    #: (vLLM's own weight-transfer client) says False and always gets the whole one
    prepared_layouts: bool = True

    @abstractmethod
    def rpc(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        """Call `method` on every worker of the replica; one result per worker."""

    @abstractmethod
    def flush_cache(self, timeout_s: float, auth: str | None = None) -> None:
        """Drop cached prefixes computed with old weights (`auth`: the signed `flush`
        message, for handles that flush through the engine contract's verb)."""

    def flush_pending(self) -> bool:
        """Whether `flush_cache` has a call to make after this push's `receive`: False
        where the engine flushed inside the receive (SGLang) or has no cache, so the
        push makes no call for it (`PushReport.rpcs`)."""
        return True

    def pause(self, timeout_s: float) -> None:  # noqa: B027 - optional
        """Stop scheduling new work so no request sees torn weights."""

    def resume(self, timeout_s: float) -> None:  # noqa: B027 - optional
        """Undo `pause`."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release client resources (HTTP sessions); the engine keeps running."""

    # -- colocated memory (the engine's own sleep mode) ---------------------------------
    def sleep(self, level: int, timeout_s: float) -> None:
        """Give the engine's accelerator memory back while training runs (vLLM `sleep`,
        SGLang `release_memory_occupation`)."""
        raise ConfigError(f"{self.name}: {type(self).__name__} has no sleep mode")

    def wake_up(self, tags: list[str], timeout_s: float) -> None:
        """Bring back the memory named by `tags` ("weights", "kv_cache")."""
        raise ConfigError(f"{self.name}: {type(self).__name__} has no sleep mode")

    def is_sleeping(self, timeout_s: float) -> bool | None:
        """Whether any of the engine's memory is asleep; None where it cannot say."""
        return None

    # -- LoRA adapters, loaded by the engine's own adapter loader -----------------------
    def load_adapter(self, upload: AdapterUpload, timeout_s: float) -> str:
        """Load one version of a LoRA adapter beside the base weights; the model name
        requests generate with (`name@version`). Raise, changing nothing, if the engine
        refuses it."""
        raise ConfigError(f"{self.name}: {type(self).__name__} does not load LoRA adapters "
                          "(VLLMServer does; or push the adapter merged, as weights)")

    def unload_adapter(self, name: str, version: str, timeout_s: float) -> None:
        """Stop serving one version of an adapter and forget its files."""
        raise ConfigError(f"{self.name}: {type(self).__name__} does not load LoRA adapters")

    # -- one tagged call -----------------------------------------------------------------
    #: How many answers of earlier calls a handle reads past to find its own
    #: (vLLM keeps the answer of a timed-out RPC and hands it to the next caller).
    max_stale_replies: int = 16

    def call(self, verb: str, *args: Any, timeout_s: float) -> list[Any]:
        """Run contract verb `verb` on every worker under a fresh call id
        (`wire/`): one result per worker, or the worker's error raised as
        the same class. An answer that belongs to another call is discarded, and the
        handle reads on (through cheap `info` calls) until its own answers arrive."""
        deadline = Deadline.after(timeout_s)
        call_id = wire.new_call_id()
        method = method_name(verb)
        replies = self._tagged_rpc(method, wire.call_arg(call_id), *args, deadline=deadline)
        found: dict[int, Any] = {}
        self._sort(replies, call_id, found)
        workers, reads = len(replies), 0
        while len(found) < workers:
            reads += 1
            if reads > self.max_stale_replies:
                raise ReplicaError(
                    self.name, f"{method}: the engine's answers are out of step with its calls "
                               f"by more than {self.max_stale_replies} (another client calls its "
                               "RPC route with a timeout?); restart the engine")
            deadline.check(f"{self.name}: {method} (reading past the answers of earlier calls)")
            ping = wire.new_call_id()
            replies = self._tagged_rpc(method_name(INFO), wire.call_arg(ping),
                                       deadline=deadline)
            self._sort(replies, call_id, found)
            workers = max(workers, len(replies))
        return [wire.unwrap(found[i], call_id, self.name) for i in range(workers)]

    @staticmethod
    def _sort(replies: list[Any], call_id: str, found: dict[int, Any]) -> None:
        """File the answers of call `call_id` by worker; others are stale: dropped."""
        for i, reply in enumerate(replies):
            if wire.answers(reply, call_id):
                found[i] = reply

    def _tagged_rpc(self, method: str, *args: Any, deadline: Deadline) -> list[Any]:
        """`rpc` for a tagged call; handles whose transport can hand back another call's
        failure (vLLM) override it to return that failure as a stale answer."""
        return self.rpc(method, *args, timeout_s=deadline.left(floor=0.001))

    # -- shared verbs -------------------------------------------------------------------
    def request(self, request: wire.Request, timeout_s: float) -> list[Any]:
        """Send one typed request (`wire/`) to every worker."""
        return self.call(request.verb, *request.args(), timeout_s=timeout_s)

    def info(self, timeout_s: float) -> list[wire.WorkerInfo]:
        """Each worker's `info` answer (what `EngineSide.info` and the engine's binding
        report), typed as the wire defines it."""
        return self.request(wire.InfoRequest(), timeout_s)

    # `auth` is the token of a signed message (`core/auth.py`): required by engines that
    # have a shared secret, ignored by the others.
    def join(self, endpoint: dict[str, Any], rank_offset: int, timeout_s: float,
             auth: str | None = None) -> None:
        self.request(wire.JoinRequest(endpoint, rank_offset, auth), timeout_s)

    def leave(self, timeout_s: float, auth: str | None = None) -> None:
        """`auth`: the leave's one argument, `wire.leave_message` (the group it
        leaves and the token signing it), or a bare token (leave whatever group)."""
        self.request(wire.LeaveRequest(auth), timeout_s)

    def check(self, manifest_json: str, timeout_s: float, auth: str | None = None) -> None:
        """Raise `ManifestError` listing every worker's problems with the manifest."""
        problems = sorted({p for ps in self.request(wire.CheckRequest(manifest_json, auth),
                                                    timeout_s) for p in ps})
        if problems:
            raise ManifestError(f"replica {self.name!r} refused the update: " + "; ".join(problems))

    def receive(self, manifest_json: str, group: str, timeout_s: float,
                auth: str | None = None) -> list[dict[str, Any]]:
        return self.request(wire.ReceiveRequest(manifest_json, group, auth), timeout_s)

    def flush_workers(self, timeout_s: float, auth: str | None = None) -> list[dict[str, Any]]:
        """The contract's `flush` verb on every worker, for engines that flush their
        prefix cache from inside the worker (`flush_cache` decides when)."""
        return self.request(wire.FlushRequest(auth), timeout_s)

    def version(self, timeout_s: float = 30.0) -> int | str | None:
        """The weight version every worker holds; None if they differ or any is torn."""
        infos = self.info(timeout_s)
        versions = {json.dumps(i.get("version")) for i in infos}
        if len(versions) != 1 or any(i.get("state") == "torn" for i in infos):
            return None
        return infos[0].get("version")

    def digests(self, names: list[str], timeout_s: float = 60.0) -> dict[str, Any]:
        """Digests of engine-side weights that the engine keeps in checkpoint layout
        (worker 0), for bit-exact checks without moving the tensors."""
        return self.request(wire.DigestsRequest(list(names)), timeout_s)[0]

