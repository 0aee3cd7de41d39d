"""The engine side's refusals and state changes, each by type and whole message, on a
real `EngineSide` (a `LocalEngine`'s, in this process): the fail-closed code every
engine plugin runs. Found by `make mutants` (engine/side.py): most of these lines
could change without any test noticing, because the end-to-end tests only ask
whether a push failed, not which refusal ended it."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

from enginehooks import WeightSync
from enginehooks.core.auth import AuthError
from enginehooks.core.errors import (
    ConfigError,
    ManifestError,
    ReplicaBusy,
    ReplicaError,
    TransportError,
)
from enginehooks.core.manifest import TensorSpec, plan
from enginehooks.engine import side as side_mod
from enginehooks.engine.local import LocalEngine
from enginehooks.engine.side import MAX_DIGEST_NAMES, ON_TORN_ENV, default_policy, refusal_of


def engine(name: str = "side") -> LocalEngine:
    torch.manual_seed(0)
    return LocalEngine(nn.Linear(3, 4), name=name)


def manifest(version: Any = 7, shape: tuple[int, ...] = (4, 3)) -> str:
    return plan([TensorSpec("weight", "float32", shape), TensorSpec("bias", "float32", (4,))],
                weight_version=version, bucket_bytes=1024).to_json()


def test_default_policy_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ON_TORN_ENV, raising=False)
    assert default_policy() == "refuse"
    monkeypatch.setenv(ON_TORN_ENV, "serve")
    assert default_policy() == "serve"
    assert engine().side.on_torn == "serve"
    monkeypatch.setenv(ON_TORN_ENV, "Serve")
    with pytest.raises(ConfigError) as err:
        default_policy()
    assert str(err.value) == "ENGINEHOOKS_ON_TORN='Serve': one of ('refuse', 'serve')"


def test_a_new_side_is_initial_and_says_so() -> None:
    s = engine().side
    state = s.public_state()
    assert {k: state[k] for k in state if k != "time"} == {
        "state": "initial", "version": None, "updating_to": None, "failed_version": None,
        "reason": None, "on_torn": "refuse", "group": None}
    info = s.info()
    assert (info["rank"], info["version"], info["state"], info["group"], info["transport"],
            info["last_error"], info["failed_version"], info["authenticated"],
            info["engine"]) == (0, None, "initial", None, None, None, None, False, "local")
    assert info["instance"] == s.instance and len(s.instance) == 32
    assert info["dtype"] == "float32" and info["wire_dtypes"] == {}


def test_a_token_to_an_engine_without_a_secret_is_refused_with_the_fix() -> None:
    s = engine().side
    with pytest.raises(AuthError) as err:
        s.check(manifest(), "some-token")
    assert str(err.value) == (
        "check refused: the trainer signs its updates but this engine has no shared secret: "
        "set ENGINEHOOKS_SECRET (or ENGINEHOOKS_SECRET_FILE) in the engine's environment too")
    assert s.check(manifest(), None) == []  # unsigned: checked


@pytest.mark.parametrize("endpoint", [["gloo"], {"transport": 3}, {"world_size": 2}])
def test_a_join_without_a_transport_is_refused(endpoint: Any) -> None:
    s = engine().side
    with pytest.raises(ConfigError) as err:
        s.join(endpoint, 1)
    assert str(err.value) == ("a group endpoint is a JSON object naming its transport, not "
                              f"{endpoint!r:.200}")
    assert s.group is None and s.transport is None


def test_a_join_with_an_unknown_policy_is_refused_and_changes_nothing() -> None:
    s = engine().side
    with pytest.raises(ConfigError) as err:
        s.join({"transport": "gloo", "on_torn": "ignore"}, 1)
    assert str(err.value) == "on_torn='ignore': one of ('refuse', 'serve')"
    assert s.on_torn == "refuse" and s.group is None


def test_receive_before_joining_is_refused() -> None:
    s = engine().side
    with pytest.raises(TransportError) as err:
        s.receive(manifest(), "g")
    assert str(err.value) == "this worker has not joined a transport group"
    assert s.state == "initial" and s.version is None
    # Half a membership (a transport's name without its receiver) is no membership.
    s.group, s.transport = "g", "gloo"
    with pytest.raises(TransportError, match=r"^this worker has not joined a transport group$"):
        s.receive(manifest(), "g")
    assert s.state == "initial"


def test_a_refused_manifest_names_every_problem_and_leaves_the_state() -> None:
    s = engine().side
    with pytest.raises(ManifestError) as err:
        s.receive(manifest(shape=(4, 5)), "g")
    assert str(err.value).startswith("refused before any data moved: ")
    assert "weight" in str(err.value) and "[4, 5]" in str(err.value)
    assert s.state == "initial"


def test_receive_for_another_group_is_refused() -> None:
    e = engine()
    with WeightSync("gloo", timeout_s=20) as sync:
        sync.add_replica(e)
        sync.push(nn.Linear(3, 4), version=1)
        s = e.side
        group = s.group
        assert group and s.state == "current" and s.version == 1
        with pytest.raises(TransportError) as err:
            s.receive(manifest(version=2), "another-group")
        assert str(err.value) == (f"this worker is in group {group!r} now, not "
                                  "'another-group': another trainer took it over; the next "
                                  "push rejoins")
        assert s.state == "current" and s.version == 1


def test_a_busy_worker_refuses_at_once_naming_the_update() -> None:
    s = engine().side
    s.updating_to, s.group = "v9", "g1"
    assert s._busy.acquire(blocking=False)
    try:
        for verb, call in (("receive", lambda: s.receive(manifest(), "g1")),
                           ("leave", lambda: s.leave(None)),
                           ("join", lambda: s.join({"transport": "gloo"}, 1))):
            with pytest.raises(ReplicaBusy) as err:
                call()
            assert str(err.value) == (f"{verb} refused: this worker is applying the update to "
                                      "version 'v9' (group g1); one update at a time")
    finally:
        s._busy.release()
    # Released after each refusal and after a normal verb: the next one runs.
    assert s._busy.acquire(blocking=False)
    s._busy.release()


def test_the_lock_is_released_when_a_verb_fails() -> None:
    s = engine().side
    with pytest.raises(TransportError):
        s.receive(manifest(), "g")
    assert s._busy.acquire(blocking=False)
    s._busy.release()


def test_a_stale_leave_is_answered_and_ignored() -> None:
    s = engine().side
    s.group = "now"
    reply = s._stale_leave("before")
    assert reply == {"left": False, "group": "before",
                     "reason": "this worker is in group 'now', not 'before': a late leave of "
                               "an earlier group, ignored"}


def test_digests_are_capped_per_call() -> None:
    s = engine().side
    assert set(s.digests(["weight"] * MAX_DIGEST_NAMES)) == {"weight"}
    with pytest.raises(ConfigError) as err:
        s.digests(["weight"] * (MAX_DIGEST_NAMES + 1))
    assert str(err.value) == "digests of 4097 tensors asked; at most 4096 per call"


def test_digests_are_crc32_of_the_checkpoint_rows() -> None:
    import zlib

    e = engine()
    d = e.side.digests(["weight", "bias", "missing"])
    w = e.target.tensors["weight"].detach().contiguous()
    assert d == {
        "weight": {"dtype": "float32", "shape": [4, 3],
                   "crc32": zlib.crc32(w.reshape(-1).view(torch.uint8).numpy())},
        "bias": {"dtype": "float32", "shape": [4],
                 "crc32": zlib.crc32(e.target.tensors["bias"].detach().view(torch.uint8)
                                     .numpy())}}


def test_refusal_follows_state_and_policy() -> None:
    s = engine().side
    assert s.refusal() is None  # initial: serve
    for state in ("updating", "torn"):
        s.state = state
        assert s.refusal() == refusal_of(s.public_state())
    s.state = "current"
    assert s.refusal() is None
    s.state, s.on_torn = "torn", "serve"
    assert s.refusal() is None


def test_a_failed_update_tears_the_worker_and_says_why() -> None:
    e = engine()

    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(4, 3))
            self.bias = nn.Parameter(torch.zeros(4))

    with WeightSync("gloo", timeout_s=20) as sync:
        sync.add_replica(e)
        sync.push(nn.Linear(3, 4), version=1)

    def fail(*a: Any, **k: Any) -> None:
        raise RuntimeError("disk on fire")

    s = e.side
    s.target.prepare = fail  # type: ignore[method-assign]
    with WeightSync("gloo", timeout_s=20) as sync:
        sync.add_replica(e)
        with pytest.raises(ReplicaError, match=r"replica 'side': RuntimeError: disk on fire"):
            sync.push(Broken(), version=2)
    assert (s.state, s.version, s.failed_version, s.updating_to) == ("torn", None, 2, None)
    assert s.last_error == "update to 2 failed: RuntimeError: disk on fire"
    assert s.public_state()["reason"] == s.last_error


def test_state_changes_reach_the_binding_in_order() -> None:
    e = engine()
    seen: list[str] = []
    lock = threading.Lock()
    real = e.side.binding.state_changed

    def record(state: dict[str, Any]) -> None:
        with lock:
            seen.append(state["state"])
        real(state)

    e.side.binding.state_changed = record  # type: ignore[method-assign]
    with WeightSync("gloo", timeout_s=20) as sync:
        sync.add_replica(e)
        sync.push(nn.Linear(3, 4), version=1)
    assert "updating" in seen and seen[-1] == "current"
    assert seen.index("updating") < len(seen) - 1
    assert side_mod.EngineSide is type(e.side)


def test_the_refusal_says_why_in_each_state() -> None:
    base = {"version": None, "on_torn": "refuse", "group": "g", "time": 0.0}
    updating = {**base, "state": "updating", "updating_to": "v2", "failed_version": None,
                "reason": None}
    assert refusal_of(updating) == {
        "error": "enginehooks: the weights are being updated to version 'v2'; generation "
                 "resumes when the update is done",
        "state": "updating", "failed_version": None, "updating_to": "v2", "reason": None}
    torn = {**base, "state": "torn", "updating_to": None, "failed_version": 3,
            "reason": "update to 3 failed: TransportError: peer left"}
    assert refusal_of(torn) == {
        "error": "enginehooks: the update to version 3 failed (update to 3 failed: "
                 "TransportError: peer left); this engine holds a mix of weight versions and "
                 "refuses generation until a push succeeds (policy on_torn='refuse')",
        "state": "torn", "failed_version": 3, "updating_to": None,
        "reason": "update to 3 failed: TransportError: peer left"}


def test_a_leave_overtaken_by_a_join_is_ignored() -> None:
    """The leave's group is checked again under the lock: a join of another group that
    ran between the first check and the lock keeps the worker in the new group."""
    from enginehooks import wire

    s = engine().side
    s.group = "old"

    class JoinFirst:
        """The worker's lock, taken over by a join of group "new" just before it."""

        def __init__(self) -> None:
            self.lock = threading.Lock()

        def acquire(self, blocking: bool = True) -> bool:
            s.group = "new"
            return self.lock.acquire(blocking)

        def release(self) -> None:
            self.lock.release()

    s._busy = JoinFirst()  # type: ignore[assignment]
    reply = s.leave(wire.leave_message("old", None))
    assert reply == {"left": False, "group": "old",
                     "reason": "this worker is in group 'new', not 'old': a late leave of an "
                               "earlier group, ignored"}
    assert s.group == "new"


def test_a_good_update_after_a_failed_one_clears_the_failure_and_reports_its_stats() -> None:
    e = engine()
    s = e.side
    real_prepare = s.target.prepare

    def fail(*a: Any, **k: Any) -> None:
        raise RuntimeError("disk on fire")

    s.target.prepare = fail  # type: ignore[method-assign]
    with WeightSync("gloo", timeout_s=20) as sync:
        sync.add_replica(e)
        with pytest.raises(ReplicaError):
            sync.push(nn.Linear(3, 4), version=1)
    assert s.state == "torn" and s.failed_version == 1
    def slow_prepare(m: Any) -> None:  # the worker's seconds count the whole receive
        time.sleep(0.3)
        real_prepare(m)

    s.target.prepare = slow_prepare  # type: ignore[method-assign]
    source = nn.Linear(3, 4)
    with WeightSync("gloo", timeout_s=20) as sync:
        sync.add_replica(e)
        report = sync.push(source, version=2)
    assert (s.state, s.version, s.failed_version, s.updating_to, s.last_error) == (
        "current", 2, None, None, None)
    assert s.refusal() is None
    ((worker,),) = [r.stats["workers"] for r in report.replicas]
    assert worker["version"] == 2 and worker["bytes"] == 64 and 0.3 <= worker["seconds"] < 20
    assert torch.equal(e.target.tensors["weight"], source.weight.detach())
    assert torch.equal(e.target.tensors["bias"], source.bias.detach())


def test_the_receive_hook_is_told_the_groups_transport() -> None:
    """Plugins that own the receive for a transport (`receive_weights`) are told which
    one the worker joined."""
    from enginehooks import hookimpl
    from enginehooks.plugins import register_plugin, unregister_plugin

    told: list[str] = []

    class Spy:
        @hookimpl(tryfirst=True)
        def receive_weights(self, transport: str, receiver: Any, manifest: Any,
                            target: Any) -> None:
            told.append(transport)
            return None  # the built-in implementation receives

    spy = Spy()
    register_plugin(spy, name="transport-spy")
    try:
        with WeightSync("gloo", timeout_s=20) as sync:
            sync.add_replica(engine())
            sync.push(nn.Linear(3, 4), version=1)
    finally:
        unregister_plugin(spy)
    assert told == ["gloo"]


def test_flush_is_authenticated_on_an_engine_with_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    # Third mutation run: `flush` checked its token with the verb's name and the token
    # given, and no test called it on an engine with a secret: either could change unseen.
    from enginehooks import wire
    from enginehooks.core.auth import SECRET_ENV

    secret = "flush-secret"
    monkeypatch.setenv(SECRET_ENV, secret)
    s = engine("guarded").side
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(AuthError, match="no valid authentication token"):
        s.flush(None)
    me = [s.instance]  # tokens name the worker they are for (issue 36)
    with pytest.raises(AuthError):  # a token for another verb with the same payload
        s.flush(wire.token(secret.encode(), "leave", me))
    with pytest.raises(AuthError, match="signed for another replica"):  # names nobody
        s.flush(wire.token(secret.encode(), "flush"))
    assert s.flush(wire.token(secret.encode(), "flush", me)) == {"flushed": None}
    # what the binding answers is what the reply carries (LocalEngine's module has no
    # cache and answers None; an engine binding that flushes in the worker answers True)
    monkeypatch.setattr(s.binding, "flush", lambda: True)
    assert s.flush(wire.token(secret.encode(), "flush", me)) == {"flushed": True}


def test_a_join_counting_another_number_of_workers_is_refused_before_anything_changes() -> None:
    # Third mutation run: join passed `replica_workers` and `expected_workers` on to the
    # world check, and dropping either one (the check then has nothing to compare) passed.
    s = engine().side
    with pytest.raises(ConfigError, match=r"^join refused: the trainer counts 2 worker\(s\) for "
                       r"this replica, which runs 1: set world_size to 2 for one replica"):
        s.join({"transport": "gloo", "world_size": 3}, 1, replica_workers=1, expected_workers=2)
    assert (s.receiver, s.transport, s.group) == (None, None, None)


def test_join_and_leave_ask_the_transport_for_the_right_member() -> None:
    """What `join` asks the transport plugins for (rank = offset + the worker's own rank,
    the worker's device, the group named by `group`, else `root`, else nothing) and what
    the next join's leave closes (the receiver, on the transport it was opened on).
    Third mutation run: `join`'s rank, device and group name and `_leave`'s transport
    could all change unseen, since every other test joins rank 0 of a gloo group on the
    CPU. The transport is a real pluggy plugin answering `update_group` first: a
    recording stand-in for a transport, so no group has to form."""
    from enginehooks import hookimpl
    from enginehooks.plugins import register_plugin, unregister_plugin
    from enginehooks.transports.base import Receiver

    asked: list[Any] = []

    class Member(Receiver):
        def connect(self) -> None:  # pragma: no cover - never receives
            pass

        def deliver(self, manifest: Any, target: Any) -> dict[str, Any]:  # pragma: no cover
            raise AssertionError("not used")

    class Recorder:
        @hookimpl(tryfirst=True)
        def update_group(self, request: Any) -> Any:
            if request.transport != "recorded":
                return None
            asked.append(request)
            return Member() if request.action == "join" else request.member

    recorder = Recorder()
    register_plugin(recorder, name="recording-transport")
    try:
        s = engine().side
        s.worker_rank = 1
        reply = s.join({"transport": "recorded", "root": "/srv/updates", "world_size": 4}, 2)
        first = s.receiver
        assert reply == {"rank": 3, "transport": "recorded", "group": "/srv/updates"}
        (join,) = asked
        assert (join.action, join.side, join.rank, join.device) == ("join", "receiver", 3, "cpu")
        assert s.group == "/srv/updates" and s.transport == "recorded"
        # a named group wins over the root; neither leaves the group name empty
        s.join({"transport": "recorded", "group": "g7", "root": "/srv", "world_size": 4}, 2)
        assert s.group == "g7"
        s.join({"transport": "recorded", "world_size": 2}, 0)
        assert s.group == ""
        leaves = [r for r in asked if r.action == "leave"]
        assert len(leaves) == 2
        assert (leaves[0].transport, leaves[0].side, leaves[0].member) == (
            "recorded", "receiver", first)
    finally:
        unregister_plugin(recorder)


def test_a_join_waits_for_a_leave_in_flight_and_other_verbs_say_what_holds_the_worker(
        tmp_path: Any) -> None:
    """A failed push sends its leaves without waiting for them; the next push's join can
    reach the worker while it still closes the old group. The join waits for that leave
    (CI caught the retry failing with "busy" before); a receive or leave does not wait,
    and every refusal says what holds the worker."""
    s = engine().side
    s.group = "g1"
    assert s._busy.acquire(blocking=False)
    s._doing = "leave"
    for verb, call in (("receive", lambda: s.receive(manifest(), "g1")),
                       ("leave", lambda: s.leave(None))):
        with pytest.raises(ReplicaBusy) as err:
            call()
        assert str(err.value) == (f"{verb} refused: this worker is still leaving group g1; "
                                  "push again")

    def finish_leave() -> None:
        time.sleep(0.5)
        s._doing = None
        s._busy.release()

    # a join that waits out the whole window for a leave says so
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(side_mod, "LEAVE_WAIT_S", 0.2)
        with pytest.raises(ReplicaBusy) as err:
            s.join({"transport": "disk", "root": str(tmp_path), "world_size": 2}, 1)
        assert str(err.value) == ("join refused: this worker is still leaving group g1 "
                                  "(waited 0.2 s for it); push again")
    threading.Thread(target=finish_leave, daemon=True).start()
    t0 = time.monotonic()
    reply = s.join({"transport": "disk", "root": str(tmp_path), "world_size": 2}, 1)
    assert time.monotonic() - t0 >= 0.4  # it waited for the leave, and then joined
    assert reply == {"rank": 1, "transport": "disk", "group": str(tmp_path)}
    assert s._doing is None and s._busy.acquire(blocking=False)
    s._busy.release()
    # A join held up by another join is refused at once, naming it
    assert s._busy.acquire(blocking=False)
    s._doing = "join"
    try:
        t0 = time.monotonic()
        with pytest.raises(ReplicaBusy) as err:
            s.join({"transport": "disk", "root": str(tmp_path), "world_size": 2}, 1)
        assert time.monotonic() - t0 < 0.4
        assert str(err.value) == ("join refused: this worker is joining a group for another "
                                  "push; one update at a time")
    finally:
        s._doing = None
        s._busy.release()
