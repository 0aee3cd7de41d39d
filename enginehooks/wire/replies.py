"""The typed replies of the verbs (`WorkerInfo`, `JoinReply`, `LeaveReply`,
`ReceiveReply`, `FlushReply`) and the check of a replica's `info` answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypedDict

from enginehooks.core.auth import AuthError
from enginehooks.core.errors import ConfigError


class JoinReply(TypedDict):
    rank: int
    transport: str
    group: str


class LeaveReply(TypedDict, total=False):
    left: bool
    group: str | None
    reason: str


class ReceiveReply(TypedDict, total=False):
    """One worker's stats of an applied update: the transport's (`Receiver.deliver`;
    the built-ins' keys are declared here, a third-party transport may add its own),
    then the worker's (`seconds` of the whole receive, the `version` applied) and the
    binding's (`flushed`: SGLang's cache flush)."""

    bytes: int
    seconds: float
    #: where the receiver's time went, per phase (broadcast, CUDA IPC)
    phases_ms: dict[str, float]
    #: the folder read (disk)
    path: str
    #: how many senders fed this worker, and whether in the planned order (several)
    senders: int
    in_order: bool
    version: int | str
    flushed: bool
    #: the engine modules the update left out whole (manifest `meta["keep"]`), which
    #: keep the values they held
    kept: list[str]
    #: what verification found for this update, and how (`engine.verify.Verifier.last`)
    verification: dict[str, Any]
    #: models updated with the main one (an MTP drafter, `engine/companions.py`): per
    #: model, the tensors it took and its own verification
    companions: dict[str, dict[str, Any]]


class FlushReply(TypedDict):
    flushed: bool | None


# -- info -------------------------------------------------------------------------------
class WorkerInfo(TypedDict, total=False):
    """What `info` answers for one worker (`authenticated` and `instance` required; a
    worker of an older enginehooks may leave out the rest). The keys `EngineSide.info`
    answers, then those the engines' bindings add (`EngineBinding.info`)."""

    rank: int
    version: int | str | None
    state: str
    group: str | None
    transport: str | None
    device: str
    #: why the last update failed, and its version (None after a good one)
    last_error: str | None
    failed_version: int | str | None
    #: what the worker does while torn or updating: "serve" or "refuse"
    on_torn: str
    #: whether this worker verifies signed updates
    authenticated: bool | None
    instance: str | None
    deployment: str | None
    dtype: str
    param_dtypes: dict[str, str]
    #: tensors the engine's loader puts in parameters of another dtype
    wire_dtypes: dict[str, str]
    #: tensors sent uncast, in the trainer's own dtype
    uncast: list[str]
    engine: str
    #: parameters no checkpoint tensor loads (the first 20)
    unloaded: list[str]
    #: the byte runs of each checkpoint tensor this worker's loader reads, once its copy
    #: plan is recorded (shard-direct, `wire/schedule.py` `needs_to_wire`)
    needs: dict[str, dict[str, Any]]
    #: a digest of `needs`, once computed for the current copy plan (`NEEDS_DIGEST_KEY`)
    needs_key: str
    # -- added by the bindings (`engine/apply.py`, SGLang's scheduler) ------------------
    beacon: str
    verification: dict[str, Any]
    copy_plan: dict[str, Any]
    engine_weight_version: int | str | None
    #: models updated with the main one (an MTP drafter, `engine/companions.py`)
    companions: dict[str, dict[str, Any]]


def check_infos(infos: Sequence[Any], who: str, secret: bool) -> list[WorkerInfo]:
    """Validate a replica's `info` answers: a JSON object per worker that says whether it
    verifies signed updates. With a secret on the trainer, a worker that says it does
    not is refused (it would accept anyone's push)."""
    out: list[WorkerInfo] = []
    for i in infos:
        if not isinstance(i, dict) or "authenticated" not in i:
            raise ConfigError(f"replica {who!r}: a worker's info does not say whether it "
                              f"verifies signed updates ({str(i)[:200]}): run the same "
                              "enginehooks version on the trainer and the engines")
        out.append(i)  # type: ignore[arg-type]
    if secret and any(i.get("authenticated") is False for i in out):
        raise AuthError(
            f"replica {who!r} runs without the shared secret and would accept anyone's "
            "push: set ENGINEHOOKS_SECRET or ENGINEHOOKS_SECRET_FILE in its environment "
            "too (docs/security.md)")
    return out
