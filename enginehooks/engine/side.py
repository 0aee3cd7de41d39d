"""Engine-agnostic receiving state of one engine worker: the verbs of the contract.

Engine plugins (vLLM worker extension, SGLang scheduler plugin, `LocalEngine`) own one
`EngineSide` per worker and route every `enginehooks_*` RPC to it through
`contract.dispatch`; they supply only an `EngineBinding`. All arguments and results
are JSON-able, since they cross engine RPC boundaries.

What it guarantees, whatever the engine:
- with a shared secret in the engine's environment (`core/auth.py`), every
  state-changing verb must carry a valid token, or it is refused and changes nothing;
- one update at a time: a verb that would change the group or the weights while an
  update is being applied is refused at once, naming that update;
- a `receive` names the group it expects; if another trainer has taken this worker
  over since (its own `join`), the receive is refused instead of reading another
  trainer's buckets;
- a `leave` names the group it leaves; one for a group the worker is no longer in (a
  leave delayed past the next `join`) is ignored, and the current group stays;
- the state says whether generation may run: "initial" (the weights it started with),
  "updating", "current", or "torn" (an update failed after data moved). Under the
  policy `on_torn="refuse"` (the default; `ENGINEHOOKS_ON_TORN` or the trainer's join)
  the engine plugins refuse generation while updating or torn (`refusal()`), with an
  error naming the version and the reason; under "serve" they serve and mark answers.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
import zlib
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch

from enginehooks import wire
from enginehooks.core.auth import (
    AuthError,
    Verifier,
    configured_server_id,
    load_secret,
    secret_scope,
)
from enginehooks.core.dtypes import dtype_name
from enginehooks.core.errors import (
    ConfigError,
    EngineHooksError,
    LayoutUnknown,
    ManifestError,
    PeerLost,
    ReplicaBusy,
    TransportError,
)
from enginehooks.core.keep import kept_modules
from enginehooks.core.layout import layout_key, layout_of, parse_reference, with_version
from enginehooks.core.manifest import Manifest
from enginehooks.engine.contract import EngineBinding, dispatch
from enginehooks.engine.copy_plan import CopyPlan, PlanState
from enginehooks.engine.expectations import Expectations
from enginehooks.engine.shard_direct import needs_of, unsent
from enginehooks.plugins import get_plugin_manager
from enginehooks.transports.base import (
    JoinReceiver,
    LeaveReceiver,
    Receiver,
    Target,
    data_plane_error,
)
from enginehooks.wire.schedule import (
    NEEDS_DIGEST_KEY,
    NEEDS_KEY,
    SCHEDULE_KEY,
    MalformedSchedule,
    ShardSchedule,
)
from enginehooks.wire.schedule import needs_to_wire as wire_needs

ON_TORN_ENV = "ENGINEHOOKS_ON_TORN"
POLICIES = ("refuse", "serve")


#: The most tensor names one `digests` call reads (each costs a crc32 of a weight).
MAX_DIGEST_NAMES = 4096
#: how many prepared layouts (`core/layout.py`) a worker keeps, the most recent
MAX_LAYOUTS = 4
#: how long a join waits for a leave in flight on the same worker (`_exclusive`)
LEAVE_WAIT_S = 30.0

__all__ = ["EngineSide", "ReplicaBusy", "default_policy", "refusal_of"]


def default_policy() -> str:
    policy = os.environ.get(ON_TORN_ENV, "refuse")
    if policy not in POLICIES:
        raise ConfigError(f"{ON_TORN_ENV}={policy!r}: one of {POLICIES}")
    return policy


class EngineSide:
    """One worker's group membership, validation, version and state (see the module
    docstring for the guarantees)."""

    def __init__(self, binding: EngineBinding) -> None:
        self.binding = binding
        self.target = binding.target()
        self.device: torch.device = self.target.device
        self.worker_rank = binding.worker_rank
        self._expectations: Expectations | None = None
        self.receiver: Receiver | None = None
        self.transport: str | None = None
        self.group: str | None = None
        self.version: int | str | None = None
        self.state = "initial"
        self.last_error: str | None = None
        self.failed_version: int | str | None = None
        self.updating_to: int | str | None = None
        self.on_torn = default_policy()
        #: this worker's id: the audience a trainer's tokens must name (`core/auth.py`)
        self.instance = uuid.uuid4().hex
        #: the deployment's id (`ENGINEHOOKS_SERVER_ID`, else the engine's own): tokens
        #: may name it instead of each worker's id; a server's route tokens name it too
        self.deployment = configured_server_id() or binding.deployment()
        secret = self.secret = load_secret()
        audience = [self.instance] + ([self.deployment] if self.deployment else [])
        self.verifier = Verifier(secret, audience=audience) if secret else None
        self._busy = threading.Lock()
        self._doing: str | None = None  # the verb holding `_busy`
        #: the engine's own model's apply target and loader checks, while `retarget`
        #: points updates at another model of the engine (a speculative draft)
        self._own: tuple[Target, Expectations | None] | None = None
        self._others: dict[int, tuple[EngineBinding, Target, Expectations]] = {}
        #: manifests this worker checked and took, by layout id (`core/layout.py`):
        #: a later push names one instead of sending it again
        self._layouts: dict[str, Manifest] = {}
        #: a scheduled layout's needs digest (`wire/schedule.NEEDS_DIGEST_KEY`) when it
        #: was checked: the schedule sends what the copy plan read then, so a plan that
        #: reads other bytes (or none) refuses the layout
        self._layout_needs: dict[str, str | None] = {}
        #: `info`'s needs, computed once per recorded copy plan (the plan they came from)
        self._needs: tuple[CopyPlan, dict[str, Any], str] | None = None
        self.binding.state_changed(self.public_state())

    def retarget(self, other: EngineBinding | None) -> None:
        """Point the next updates at another model the engine holds (a speculative draft
        model: `other` binds it, with its own loader, checks and verification), or back at
        the engine's own model (None). Group, version and state stay this worker's: a
        draft is pushed with the policy, under the policy's version."""
        if other is None:
            if self._own is not None:
                self.target, self._expectations = self._own
                self._own = None
            return
        if self._own is None:
            self._own = (self.target, self._expectations)
        if id(other) not in self._others:  # built once: a target keeps its copy plan
            self._others[id(other)] = (other, other.target(), other.expectations())
        _, self.target, self._expectations = self._others[id(other)]

    def call(self, verb: str, *args: Any) -> Any:
        """Run a contract verb with raw (possibly JSON-text) arguments. With a call id in
        front of them (`wire/`) the answer is an Ok/Err envelope echoing
        it, and errors travel back by class name instead of being raised."""
        call_id, rest = wire.split_call(args)
        if call_id is None:
            return dispatch(self, verb, rest)
        try:
            return wire.ok(call_id, dispatch(self, verb, rest))
        except Exception as e:
            return wire.err(call_id, e)

    def expectations(self) -> Expectations:
        if self._expectations is None:
            self._expectations = self.binding.expectations()
        return self._expectations

    # -- state --------------------------------------------------------------------------
    def public_state(self) -> dict[str, Any]:
        return {"state": self.state, "version": self.version, "updating_to": self.updating_to,
                "failed_version": self.failed_version, "reason": self.last_error,
                "on_torn": self.on_torn, "group": self.group, "time": time.time()}

    def _set_state(self, state: str) -> None:
        self.state = state
        self.binding.state_changed(self.public_state())

    def refusal(self) -> dict[str, Any] | None:
        """Why generation must be refused now (None: serve). Engine plugins call it for
        every generation request."""
        if self.on_torn != "refuse" or self.state not in ("updating", "torn"):
            return None
        return refusal_of(self.public_state())

    @contextlib.contextmanager
    def anonymous_audience(self) -> Iterator[None]:
        """Within this block a token that names no worker is taken (one that names
        others is still refused). Only vLLM's own weight-transfer calls use it: their
        trainer cannot ask the workers for their ids (those calls answer nothing), and
        where they travel over HTTP the server's route guard binds each request to this
        server (`fail_closed.py`); in-process and through Ray no network is in between."""
        self._anonymous_ok = True
        try:
            yield
        finally:
            self._anonymous_ok = False

    def _authorize(self, verb: str, token: str | None, **fields: Any) -> None:
        if self.verifier is not None:
            wire.verify_token(self.verifier, verb, token,
                              getattr(self, "_anonymous_ok", False), **fields)
            return
        wire.signed_payload(verb, **fields)  # a verb that is not signed is a bug
        if token is not None:
            # The trainer signs because it has a secret; this engine has none and would
            # accept anyone's push: refuse, so mixed setups fail at the first join on
            # every path (vLLM's own weight-transfer calls cannot ask `info` first).
            raise AuthError(f"{verb} refused: the trainer signs its updates but this engine "
                            "has no shared secret: set ENGINEHOOKS_SECRET (or "
                            "ENGINEHOOKS_SECRET_FILE) in the engine's environment too")

    @contextlib.contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        """Run a state-changing verb alone, or refuse it at once (never wait: a second
        trainer must hear "busy", not block behind the first one's update).

        One exception: a join waits (up to `LEAVE_WAIT_S`) for a leave in flight. A
        trainer whose push failed sends its leaves without waiting for them, so its
        next push's join can reach a worker still closing the old group; that leave is
        short, and refusing the join would fail a healthy retry."""
        if not self._busy.acquire(blocking=False):
            doing = self._doing
            if not (what == "join" and doing == "leave"
                    and self._busy.acquire(timeout=LEAVE_WAIT_S)):
                raise ReplicaBusy(self._busy_reason(what, doing))
        self._doing = what
        try:
            yield
        finally:
            self._doing = None
            self._busy.release()

    def _busy_reason(self, what: str, doing: str | None) -> str:
        if doing == "leave":
            waited = f" (waited {LEAVE_WAIT_S:g} s for it)" if what == "join" else ""
            return (f"{what} refused: this worker is still leaving group {self.group}"
                    f"{waited}; push again")
        if doing == "join":
            return (f"{what} refused: this worker is joining a group for another push; "
                    "one update at a time")
        return (f"{what} refused: this worker is applying the update to version "
                f"{self.updating_to!r} (group {self.group}); one update at a time")

    # -- the verbs ----------------------------------------------------------------------
    def info(self, needs: bool | None = None) -> wire.WorkerInfo:
        """This worker's facts (`wire.WorkerInfo`), with the binding's extras (the keys
        `WorkerInfo` lists for them). `needs`: add the byte runs this worker's loader
        reads (shard-direct, `_needs_info`), asked for only by a trainer that schedules
        shard-direct: they are large for a large model, and every full push asks `info`."""
        dtype = self.binding.dtype()
        return cast(wire.WorkerInfo, {
            "rank": self.worker_rank,
            "version": self.version,
            "state": self.state,
            "group": self.group,
            "transport": self.transport,
            "device": str(self.device),
            "last_error": self.last_error,
            "failed_version": self.failed_version,
            "on_torn": self.on_torn,
            # whether this worker verifies signed updates (a trainer with a secret
            # refuses to push to one that does not: it would accept anyone's push)
            "authenticated": self.verifier is not None,
            "instance": self.instance,
            "deployment": self.deployment,
            "dtype": dtype,
            # tensors the engine's loader puts in parameters of another dtype
            "wire_dtypes": {n: d for n, d in self.expectations().wire_dtypes().items()
                            if d != dtype},
            # tensors its loader computes on before they land: sent uncast, in the
            # trainer's own dtype, as a fresh load of the trainer's checkpoint reads them
            "uncast": self.expectations().uncast(),
            "engine": self.binding.engine,
            # parameters no checkpoint tensor loads: a fresh load leaves them as built
            "unloaded": self.expectations().unloaded()[:20],
            **(self._needs_info() if needs else self._needs_digest()),
            **self.binding.info(),
        })

    def _needs_info(self) -> dict[str, Any]:
        """`info`'s `needs` (shard-direct, `wire/schedule.py`): the byte runs of each
        checkpoint tensor this worker's loader reads, from the copy plan its target
        recorded (`engine/shard_direct.needs_of`); nothing while no usable plan is
        recorded (a trainer then cannot schedule shard-direct: it broadcasts)."""
        plan = self._usable_plan()
        if plan is None:
            return {}
        if self._needs is None or self._needs[0] is not plan:
            specs = [r.spec for r in plan.routes.values()]
            runs = wire_needs(needs_of(plan, specs), specs)
            self._needs = (plan, runs, layout_key(runs))
        return {NEEDS_KEY: self._needs[1], NEEDS_DIGEST_KEY: self._needs[2]}

    def _needs_digest(self) -> dict[str, Any]:
        """`info`'s `needs_key` (`wire/schedule.NEEDS_DIGEST_KEY`) of the current plan's
        needs (computed once per plan): a trainer holding them asks no more, and a
        prepared schedule goes on while a plan recorded anew reads the same bytes.
        Nothing until a trainer asked for the needs once (only one that schedules
        shard-direct does: the other transports never pay for them)."""
        key = self._needs_key() if self._needs is not None else None
        return {} if key is None else {NEEDS_DIGEST_KEY: key}

    def _needs_key(self) -> str | None:
        """The digest of the current plan's needs; None without a usable plan."""
        return self._needs_info().get(NEEDS_DIGEST_KEY)

    def join(self, endpoint: dict[str, Any], rank_offset: int,
             auth: str | None = None, *, replica_workers: int | None = None,
             expected_workers: int | None = None) -> wire.JoinReply:
        """Join the group described by `endpoint` as rank `rank_offset + worker_rank`
        (leaving any previous group: a later trainer takes the worker over).

        A world size that cannot hold this worker, or a trainer that counts another
        number of workers for this replica (`expected_workers`) than it has
        (`replica_workers`, where the engine knows it), is refused at once with the fix:
        otherwise the group waits out its timeout for peers that never come."""
        self._authorize("join", auth, endpoint=endpoint, rank_offset=rank_offset)
        if not isinstance(endpoint, dict) or not isinstance(endpoint.get("transport"), str):
            raise ConfigError(f"a group endpoint is a JSON object naming its transport, not "
                              f"{endpoint!r:.200}")
        wire.check_world(endpoint.get("world_size"), rank_offset, self.worker_rank,
                             replica_workers, expected_workers)
        with self._exclusive("join"):
            self.expectations()  # derive them now, before an update could move the model
            policy = endpoint.get("on_torn", self.on_torn)
            if policy not in POLICIES:
                raise ConfigError(f"on_torn={policy!r}: one of {POLICIES}")
            self._leave()
            rank = rank_offset + self.worker_rank
            transport = str(endpoint["transport"])
            with secret_scope(self.secret):  # the receiver signs with this worker's secret
                self.receiver = JoinReceiver(transport, dict(endpoint), rank,
                                             str(self.device)).ask(get_plugin_manager())
            self.transport = transport
            self.group = wire.group_id(endpoint) or ""
            self.on_torn = policy
            self.binding.state_changed(self.public_state())
            return wire.JoinReply(rank=rank, transport=transport, group=self.group)

    def leave(self, message: str | None = None) -> wire.LeaveReply:
        """Leave the group named by `message` (`wire.leave_message`: the group and
        its token). A leave for a group this worker is no longer in is ignored and
        answered `left: False`: the network can deliver the leave of a failed push after
        the next push's join (TCP retransmits it once a partition heals), and it must
        not take the worker out of the new group. A message that names no group (a
        bare token, or none) leaves whatever group the worker is in."""
        group, auth = wire.parse_leave(message)
        self._authorize("leave", auth, group=group)
        if group is not None and group != self.group:
            return self._stale_leave(group)  # without the lock: never "busy" for it
        with self._exclusive("leave"):
            if group is not None and group != self.group:  # a join came first
                return self._stale_leave(group)
            self._leave()
        return wire.LeaveReply(left=True, group=group)

    def _stale_leave(self, group: str) -> wire.LeaveReply:
        return wire.LeaveReply(
            left=False, group=group, reason=f"this worker is in group {self.group!r}, not "
                                            f"{group!r}: a late leave of an earlier group, ignored")

    def _leave(self) -> None:
        if self.receiver is not None and self.transport is not None:
            LeaveReceiver(self.transport, self.receiver).ask(get_plugin_manager())
        self.receiver, self.transport, self.group = None, None, None

    def check(self, manifest_json: str, auth: str | None = None) -> list[str]:
        self._authorize("check", auth, manifest=manifest_json)
        return self._problems(Manifest.from_json(manifest_json))

    def _problems(self, manifest: Manifest) -> list[str]:
        # `meta["keep"]`: whole modules the update leaves out (frozen parts), which
        # the engine keeps as they are where it can keep them whole (asked only then:
        # an `Expectations` written before `keep` existed still answers full updates)
        keep = kept_modules(manifest.meta)
        problems = (self.expectations().problems(manifest.specs(), keep=keep) if keep
                    else self.expectations().problems(manifest.specs()))
        return problems + self._schedule_problems(manifest)

    def _usable_plan(self) -> CopyPlan | None:
        state = getattr(self.target, "plan", None)
        return state.plan if isinstance(state, PlanState) and state.usable else None

    def _schedule_problems(self, manifest: Manifest) -> list[str]:
        """A manifest with a shard-direct schedule (`wire/schedule.py`) is refused at
        check, before a byte moves, where this worker cannot follow it: a malformed
        schedule, one that names no engine rank for this worker, no recorded copy plan
        to land it with, or bytes its loader reads that no transfer gives it."""
        if SCHEDULE_KEY not in manifest.meta:
            return []
        try:
            sched = ShardSchedule.of(manifest)
            me = sched.rank_of(self.instance)
        except MalformedSchedule as e:
            return [f"shard-direct schedule: {e}"]
        plan = self._usable_plan()
        if plan is None:
            return ["shard-direct schedule: this worker has no usable recorded copy plan "
                    "to land it with"]
        return [f"shard-direct schedule: bytes [{s.start}, {s.stop}) of {s.name!r}, which "
                f"this worker's loader reads (engine rank {me}), are not sent to it"
                for s in unsent(plan, manifest.specs(), sched.transfers, me)[:5]]

    def receive(self, manifest_json: str, group: str,
                auth: str | None = None) -> wire.ReceiveReply:
        """Take and apply an update: `manifest_json` is the whole manifest, or a
        reference to a layout this worker checked and took before (`core/layout.py`),
        which is that manifest again under a new weight version."""
        ref = parse_reference(manifest_json)
        if ref is not None and ref[0] not in self._layouts:
            # before the token: a restarted worker (a new instance, which the trainer's
            # token does not name yet) must say "no such layout", not "bad token", so
            # the trainer takes the full path; nothing is changed here either way
            raise LayoutUnknown(f"this worker holds no layout {ref[0]!r} (restarted since, "
                                "or it never took that layout): push the whole manifest")
        self._authorize("receive", auth, manifest=manifest_json, group=group)
        with self._exclusive("receive"):
            if ref is not None:
                if self.receiver is None or group != self.group:
                    # a prepared push assumes the group it was prepared in: another
                    # trainer took this worker over, or it left; the full path rejoins
                    raise LayoutUnknown(f"this worker is in group {self.group!r} now, not "
                                        f"{group!r}: push the whole manifest (it rejoins)")
                kept = self._layouts[ref[0]]
                if (SCHEDULE_KEY in kept.meta
                        and self._layout_needs.get(ref[0]) != self._needs_key()):
                    # the schedule was checked against what the copy plan read then; a
                    # plan turned off, or recorded anew reading other bytes, cannot land it
                    raise LayoutUnknown("this worker's copy plan changed since it took "
                                        f"layout {ref[0]!r}: push the whole manifest (the "
                                        "schedule is computed anew)")
                return self._receive(with_version(kept, ref[1]), group, checked=True)
            return self._receive(Manifest.from_json(manifest_json), group)

    def _receive(self, m: Manifest, group: str, checked: bool = False) -> wire.ReceiveReply:
        """`checked`: `m` is a layout this worker took before (its verdict is kept)."""
        problems = [] if checked else self._problems(m)
        if problems:
            raise ManifestError("refused before any data moved: " + "; ".join(problems))
        layout = layout_of(m)
        if layout is not None and not checked:
            # the trainer may name it from now on; the oldest goes when there are more
            self._layouts.pop(layout, None)
            self._layouts[layout] = m
            if SCHEDULE_KEY in m.meta:
                self._layout_needs[layout] = self._needs_key()
            while len(self._layouts) > MAX_LAYOUTS:
                gone = next(iter(self._layouts))
                self._layouts.pop(gone)
                self._layout_needs.pop(gone, None)
        receiver = self.receiver
        if receiver is None or self.transport is None:
            raise TransportError("this worker has not joined a transport group")
        if group != self.group:
            raise TransportError(f"this worker is in group {self.group!r} now, not {group!r}: "
                                 "another trainer took it over; the next push rejoins")
        t0 = time.perf_counter()
        self.updating_to = m.weight_version
        self._set_state("updating")
        try:
            self.target.prepare(m)
            stats = get_plugin_manager().hook.receive_weights(
                transport=self.transport, receiver=receiver, manifest=m, target=self.target)
        except BaseException as e:
            self.version, self.failed_version, self.updating_to = None, m.weight_version, None
            self.last_error = f"update to {m.weight_version!r} failed: {type(e).__name__}: {e}"
            if receiver.broken:
                self.receiver, self.transport, self.group = None, None, None
            self._set_state("torn")
            if isinstance(e, RuntimeError) and not isinstance(e, EngineHooksError):
                # torch.distributed's own exception escaped the transport: give it the
                # class that says whose failure it was (a lost peer is not this worker's)
                classified = data_plane_error(e, "receive")
                if isinstance(classified, PeerLost):
                    raise classified from e
            raise
        self.version, self.failed_version, self.updating_to = m.weight_version, None, None
        self.last_error = None
        stats = dict(stats or {})
        stats["seconds"] = time.perf_counter() - t0
        stats["version"] = m.weight_version
        keep = kept_modules(m.meta)
        if keep:  # the engine modules this update left on the values they held
            kept = getattr(self.expectations(), "kept", None)
            stats["kept"] = kept(m.specs(), keep) if callable(kept) else list(keep)
        stats.update(self.binding.after_update(m.weight_version))
        verifier = getattr(self.target, "verifier", None)
        if verifier is not None and verifier.last is not None:
            # what this update's verification found and how (the push report carries it)
            stats["verification"] = dict(verifier.last)
        self._set_state("current")
        return cast(wire.ReceiveReply, stats)

    def digests(self, names: Iterable[str]) -> dict[str, Any]:
        """crc32 of weights the engine keeps in checkpoint layout (embeddings, norms;
        fused or prepacked ones are skipped), for bit-exact checks that move no tensor.
        A vocabulary padded by the engine is compared on the checkpoint's rows."""
        names = list(names)
        if len(names) > MAX_DIGEST_NAMES:
            raise ConfigError(f"digests of {len(names)} tensors asked; at most "
                              f"{MAX_DIGEST_NAMES} per call")
        params, expect = self.binding.readable(), self.expectations()
        out: dict[str, Any] = {}
        for name in names:
            p, spec = params.get(name), expect.checkpoint_spec(name)
            if p is None or spec is None or p.dim() != len(spec.shape):
                continue
            if tuple(p.shape[1:]) != tuple(spec.shape[1:]) or p.shape[0] < spec.shape[0]:
                continue
            data = p.detach()[: spec.shape[0]].contiguous().cpu()
            out[name] = {"dtype": dtype_name(data.dtype), "shape": list(data.shape),
                         "crc32": zlib.crc32(data.reshape(-1).view(torch.uint8).numpy().data)}
        return out

    def flush(self, auth: str | None = None) -> wire.FlushReply:
        self._authorize("flush", auth)
        return wire.FlushReply(flushed=self.binding.flush())


def refusal_of(state: dict[str, Any]) -> dict[str, Any]:
    """The error an engine answers a generation request with while `state` (a
    `public_state()`) says it is updating or torn: JSON for an HTTP 503 body, or the
    message of the exception raised in-process."""
    if state["state"] == "updating":
        message = (f"enginehooks: the weights are being updated to version "
                   f"{state['updating_to']!r}; generation resumes when the update is done")
    else:
        message = (f"enginehooks: the update to version {state['failed_version']!r} failed "
                   f"({state['reason']}); this engine holds a mix of weight versions and "
                   "refuses generation until a push succeeds (policy on_torn='refuse')")
    return {"error": message, "state": state["state"], "failed_version": state["failed_version"],
            "updating_to": state["updating_to"], "reason": state["reason"]}
