"""The protocol's protective checks, on real in-process replicas (`LocalEngine`: the
same `EngineSide` every engine worker runs) and real gloo groups (issue 19):

- tokens are fresh (the freshness window), bound to the replica they were signed for
  (audience), and an engine without a secret refuses signed messages;
- every RPC carries a call id; errors travel by class name and come back as the same
  `EngineHooksError` subclass on every channel;
- `check` refuses manifests beyond the caps (unknown digest, a 1 TiB bucket), digests
  of unbounded name lists are refused;
- a refused join ends the push at once, not after `timeout_s`;
- `info` must say whether the worker verifies signatures.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

from enginehooks import WeightSync, wire
from enginehooks.core import errors
from enginehooks.core.auth import SECRET_ENV, WINDOW_S, AuthError, sign
from enginehooks.core.manifest import MAX_BUCKET_BYTES, TensorSpec, plan
from enginehooks.engine.local import LocalEngine
from enginehooks.engine.side import MAX_DIGEST_NAMES

SECRET = "protocol-test-secret"


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))


def manifest(**overrides: Any) -> str:
    specs = [TensorSpec(n, "float32", tuple(t.shape)) for n, t in net(0).state_dict().items()]
    m = plan(specs, weight_version=1, bucket_bytes=1 << 20, checksum="xxh3").to_dict()
    m.update(overrides)
    return json.dumps(m)


@pytest.fixture
def guarded(monkeypatch: pytest.MonkeyPatch) -> list[LocalEngine]:
    """Two replicas whose engine processes have the shared secret."""
    monkeypatch.setenv(SECRET_ENV, SECRET)
    engines = [LocalEngine(net(0), name="replica-a"), LocalEngine(net(0), name="replica-b")]
    monkeypatch.delenv(SECRET_ENV)
    return engines


def test_a_token_older_than_the_window_is_refused(guarded: list[LocalEngine]) -> None:
    a = guarded[0]
    m = manifest()
    aud = [a.side.instance]
    old = sign(SECRET.encode(), "check", wire.signed_payload("check", manifest=m), aud,
               ts=time.time() - WINDOW_S - 30)
    with pytest.raises(AuthError, match=r"old \(window"):
        a.side.call("check", m, old)
    future = sign(SECRET.encode(), "check", wire.signed_payload("check", manifest=m), aud,
                  ts=time.time() + WINDOW_S + 30)
    with pytest.raises(AuthError, match="window"):
        a.side.call("check", m, future)
    fresh = sign(SECRET.encode(), "check", wire.signed_payload("check", manifest=m), aud)
    assert a.side.call("check", m, fresh) == []


def test_a_token_signed_for_one_replica_is_refused_by_another(guarded: list[LocalEngine]) -> None:
    a, b = guarded
    m = manifest()
    token = sign(SECRET.encode(), "check", wire.signed_payload("check", manifest=m),
                 [a.side.instance])
    with pytest.raises(AuthError, match="another replica"):
        b.side.call("check", m, token)
    assert a.side.call("check", m, token) == []
    # The audience is inside the MAC: rewriting it to name B breaks the signature.
    forged = dict(json.loads(token), aud=[b.side.instance])
    with pytest.raises(AuthError, match="does not match"):
        b.side.call("check", m, json.dumps(forged))


def test_pushes_sign_for_each_replica_and_work(guarded: list[LocalEngine]) -> None:
    src = net(3)
    with WeightSync("gloo", timeout_s=30, secret=SECRET) as sync:
        for e in guarded:
            sync.add_replica(e)
        assert sync.push(src, version=3).ok
    for e in guarded:
        assert e.side.version == 3


def test_an_engine_without_a_secret_refuses_signed_messages() -> None:
    """The engine side of "a trainer with a secret never pushes into an engine that
    would accept anyone's push": it holds where the trainer cannot ask `info` (vLLM's
    own weight-transfer calls)."""
    open_engine = LocalEngine(net(0), name="no-secret")
    m = manifest()
    token = sign(SECRET.encode(), "check", wire.signed_payload("check", manifest=m))
    with pytest.raises(AuthError, match=r"no shared secret.*ENGINEHOOKS_SECRET"):
        open_engine.side.call("check", m, token)
    assert open_engine.side.call("check", m) == []


def test_a_refused_join_ends_the_push_at_once(guarded: list[LocalEngine]) -> None:
    """The join is refused in milliseconds (wrong secret); the push must not wait for
    the group to form for its whole timeout."""
    t0 = time.monotonic()
    with WeightSync("gloo", timeout_s=120, secret="not-the-secret") as sync:
        sync.add_replica(guarded[0])
        with pytest.raises(AuthError, match="join refused"):
            sync.push(net(2), version=9)
    assert time.monotonic() - t0 < 20
    assert guarded[0].side.state == "initial"


def test_a_join_refused_by_one_replica_ends_the_push_on_every_replica(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Replica A refuses its join (another secret) while replica B has joined and waits
    for the group to form: the push fails at once naming A, and B is not left waiting
    out the group's timeout (the next push, without A, lands on B at once)."""
    monkeypatch.setenv(SECRET_ENV, "another-secret")
    a = LocalEngine(net(0), name="a-other-secret")
    monkeypatch.setenv(SECRET_ENV, SECRET)
    b = LocalEngine(net(0), name="b")
    monkeypatch.delenv(SECRET_ENV)
    t0 = time.monotonic()
    with WeightSync("gloo", timeout_s=60, secret=SECRET) as sync:
        sync.add_replica(b)
        sync.add_replica(a)
        with pytest.raises(AuthError, match="join refused") as got:
            sync.push(net(1), version=1)
        assert got.value.replica == "a-other-secret"
        assert time.monotonic() - t0 < 30
        sync.remove_replica(a)
        # Before: b's worker still waited in the group's rendezvous (ReplicaBusy here).
        assert sync.push(net(2), version=2).ok
    assert time.monotonic() - t0 < 50  # b's wait alone was the group's timeout, 60 s
    assert b.side.version == 2 and a.side.state == "initial"


def test_vllms_init_info_carries_a_worker_count_that_must_be_an_int() -> None:
    """The count of workers the trainer assumes travels in vLLM's init info; anything
    but an int is refused before a worker compares it with its deployment's."""
    pytest.importorskip("vllm")
    from enginehooks.vllm_ext.transfer_engine import EnginehooksInitInfo

    ep = {"transport": "gloo", "world_size": 3}
    assert EnginehooksInitInfo(endpoint=ep, workers=2).workers == 2
    assert EnginehooksInitInfo(endpoint=ep).workers is None
    for bad in (True, "2", 2.0):
        with pytest.raises(errors.ConfigError, match="workers must be an int"):
            EnginehooksInitInfo(endpoint=ep, workers=bad)  # type: ignore[arg-type]


def test_a_join_outside_the_world_size_is_refused_at_once_with_the_fix() -> None:
    """A worker whose rank the group has no room for refuses the join before touching
    the transport (it would wait out the group's timeout), naming the fix; so does a
    trainer that counts another number of workers for the replica than it runs."""
    engine = LocalEngine(net(0), name="local")
    endpoint = {"transport": "gloo", "world_size": 2, "host": "127.0.0.1", "port": 1,
                "timeout_s": 120}
    t0 = time.monotonic()
    with pytest.raises(errors.ConfigError, match=r"rank 2 of a group of world_size 2.*"
                                                  r"world_size=1 \+ workers"):
        engine.side.call("join", endpoint, 2)
    with pytest.raises(errors.ConfigError, match="not an int >= 2"):
        engine.side.call("join", dict(endpoint, world_size="3"), 1)
    assert time.monotonic() - t0 < 5
    with pytest.raises(errors.ConfigError, match=r"counts 3 worker\(s\).*runs 1: set "
                                                  r"world_size to 2"):
        wire.check_world(4, 1, 0, replica_workers=1, expected_workers=3)
    wire.check_world(2, 1, 0, replica_workers=1, expected_workers=1)
    wire.check_world(None, 1, 0, replica_workers=None, expected_workers=3)
    assert engine.side.group is None and engine.side.state == "initial"


@pytest.mark.parametrize("name", sorted(
    n for n, c in wire.error_classes().items()
    if c not in (errors.ReplicaError, errors.EngineTorn)))
def test_every_error_class_survives_the_envelope(name: str) -> None:
    """What a worker raises reaches the trainer as the same class (over JSON text,
    as every channel carries it)."""
    cls = wire.error_classes()[name]
    try:
        raised = cls("a message")
    except TypeError:
        pytest.skip(f"{name} is not built from a message")
    sent = json.loads(json.dumps(wire.err("c0ffee", raised)))
    with pytest.raises(cls) as got:
        wire.unwrap(sent, "c0ffee", "replica-x")
    assert type(got.value) is cls and "a message" in str(got.value)
    assert got.value.replica == "replica-x"


def test_checksum_errors_keep_their_class_through_a_handle() -> None:
    assert wire.restore_error("ChecksumError", "bucket 3", "r").__class__ is \
        errors.ChecksumError
    engine = LocalEngine(net(0), name="local")
    with pytest.raises(errors.TransportError, match="has not joined"):
        engine.receive(manifest(), "no-group", timeout_s=10)


def test_an_answer_to_another_call_is_never_taken_for_this_one() -> None:
    engine = LocalEngine(net(0), name="local")
    late = engine.side.call("info", wire.call_arg("aaaa"))
    with pytest.raises(wire.StaleReply):
        wire.unwrap(late, "bbbb", "local")
    with pytest.raises(wire.StaleReply):
        wire.unwrap([[]], "bbbb", "local")  # an untagged answer


@pytest.mark.parametrize("overrides, why", [
    ({"checksum": "md5"}, "unknown checksum 'md5'"),
    ({"bucket_bytes": 1 << 40, "buckets": [[0, 1 << 40, None]]}, "exceeds the cap"),
    ({"buckets": [[0, 1 << 40, None]], "meta": {"unsplit": True}}, "exceed the cap"),
])
def test_check_refuses_manifests_beyond_the_caps(overrides: dict[str, Any], why: str) -> None:
    assert MAX_BUCKET_BYTES < 1 << 40
    engine = LocalEngine(net(0), name="local")
    with pytest.raises(errors.ManifestError, match=why):
        engine.check(manifest(**overrides), timeout_s=10)
    assert engine.side.state == "initial"


def test_digests_of_unbounded_name_lists_are_refused() -> None:
    engine = LocalEngine(net(0), name="local")
    assert set(engine.digests(["0.weight"], timeout_s=10)) == {"0.weight"}
    with pytest.raises(errors.ConfigError, match="at most"):
        engine.digests([f"n{i}" for i in range(MAX_DIGEST_NAMES + 1)], timeout_s=10)


class OlderEngine(LocalEngine):
    """A replica whose `info` does not say whether it verifies signatures."""

    def info(self, timeout_s: float) -> list[dict[str, Any]]:
        return [{k: v for k, v in i.items() if k != "authenticated"}
                for i in super().info(timeout_s)]


def test_info_must_say_whether_the_worker_verifies_signatures() -> None:
    with WeightSync("gloo", timeout_s=20, secret=SECRET) as sync:
        sync.add_replica(OlderEngine(net(0), name="older"))
        with pytest.raises(errors.ConfigError, match="verifies signed updates"):
            sync.push(net(1), version=1)


class LaggingQueue(LocalEngine):
    """Stand-in for vLLM's worker queue after a `collective_rpc` timed out: every call
    runs, but each answer comes back one call late (vLLM hands the late answer to the
    next caller). The real server test cannot make a real queue lag any more (the
    endpoint plugin refuses RPCs with a timeout), so the handle's side of the defence
    is checked here, on a real `EngineSide`."""

    def __init__(self, module: nn.Module, name: str) -> None:
        super().__init__(module, name=name)
        self.queue: list[list[Any]] = [[["a late answer of an earlier call"]]]

    def rpc(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        self.queue.append(super().rpc(method, *args, timeout_s=timeout_s))
        return self.queue.pop(0)


def test_a_handle_reads_past_answers_that_are_not_its_own() -> None:
    lagging = LaggingQueue(net(0), name="lagging")
    src = net(5)
    with WeightSync("gloo", timeout_s=30) as sync:
        sync.add_replica(lagging)
        assert sync.push(src, version=5).ok
    assert lagging.side.version == 5 and lagging.version(10) == 5
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(),
                                                 lagging.target.module.state_dict().values()))
    with pytest.raises(errors.ManifestError, match="unknown checksum"):
        lagging.check(manifest(checksum="md5"), timeout_s=10)  # its own answer, not the last
    assert lagging.check(manifest(), timeout_s=10) is None


def test_the_security_page_gives_no_advice_a_test_shows_false() -> None:
    """docs/security.md named a `headers=` argument no handle has (TypeError) and said
    `--api-key` guards vLLM's dev routes; the handles take `api_key=` and `secret=`."""
    from pathlib import Path

    from enginehooks.vllm_ext import VLLMServer

    text = (Path(__file__).resolve().parents[3] / "docs" / "security.md").read_text()
    assert "headers=" not in text
    assert "does **not** guard these routes" in text and "X-Enginehooks-Auth" in text
    VLLMServer("http://127.0.0.1:1", api_key="k", secret="s")  # the arguments it names
    from enginehooks.sglang_ext import SGLangServer

    SGLangServer("http://127.0.0.1:1", api_key="k", secret="s")
    # SGLang's admin routes are guarded now (tests/sglang/security/test_server.py).
    assert "are not\n  guarded by enginehooks" not in text


def test_the_security_page_cites_tests_that_exist() -> None:
    """Every test the threat model cites (`file.py::test_name`, `tests/...py`) exists,
    so the page states what the tests check, not what they once did."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    text = (root / "docs" / "security.md").read_text()
    files = {p.name: p for p in (root / "tests").rglob("test_*.py")}
    cited = re.findall(r"(test_\w+\.py)(?:::(test_\w+))?", text)
    assert len(cited) >= 15, cited
    for name, test in cited:
        assert name in files, name
        if test:
            assert re.search(rf"def {test}\(", files[name].read_text()), f"{name}::{test}"
    for path in re.findall(r"`(tests/[\w/]+\.py)", text):
        assert (root / path).is_file(), path


@pytest.mark.parametrize("cls", [errors.ChecksumError, AuthError, errors.ReplicaBusy,
                                 errors.SenderAborted])
def test_ray_replies_restore_every_enginehooks_error(cls: type[Exception]) -> None:
    """The Ray channel kept seven classes and turned the rest into `ReplicaError`."""
    from enginehooks.ray_ext.calls import raise_reply

    with pytest.raises(cls, match="bucket 2"):
        raise_reply({"error": cls.__name__, "message": "bucket 2"}, "actor-0", "receive")


#: What only the wire package `enginehooks/wire/` (and the primitives in `core/auth.py`)
#: may contain.
_PROTOCOL_ONLY = """
- canonical(...): building a payload text
- sign(...) / <verifier>.verify(...): making or checking a control-plane token
- a dict literal with a "call" key, or "enginehooks" with "ok"/"error": an envelope
- x["call"] / x.get("call"): reading an envelope
- {"result": ...} / {"error": ..., "message": ...}: a reply of an untagged channel
- the strings "enginehooks-call:...", "X-Enginehooks-Auth" and "[enginehooks-error:"
- {"group": ..., "auth": ...}: a leave's message
- handle.call(<verb>, ...): a verb's arguments built by hand, not from its request
- class X(Message) / {"op": ...}: a message between trainer ranks (wire/ranks.py)
"""
_VERB_NAMES = {"INFO", "JOIN", "LEAVE", "CHECK", "RECEIVE", "DIGESTS", "FLUSH"}


def _protocol_offences(source: str) -> list[tuple[int, str]]:
    import ast

    from enginehooks.engine.contract import VERBS

    out: list[tuple[int, str]] = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Call):
            f = n.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in ("canonical", "sign"):
                out.append((n.lineno, f"{name}()"))
            elif name == "verify" and "verifier" in ast.unparse(f).lower():
                out.append((n.lineno, "verifier.verify()"))
            elif name == "get" and n.args and isinstance(n.args[0], ast.Constant) \
                    and n.args[0].value == "call":
                out.append((n.lineno, '.get("call")'))
            elif name == "call" and n.args and (
                    (isinstance(n.args[0], ast.Name) and n.args[0].id in _VERB_NAMES)
                    or (isinstance(n.args[0], ast.Constant) and n.args[0].value in VERBS)):
                out.append((n.lineno, f"call({ast.unparse(n.args[0])}, ...)"))
        elif isinstance(n, ast.ClassDef) and any(
                ast.unparse(b).split(".")[-1] == "Message" for b in n.bases):
            out.append((n.lineno, f"class {n.name}(Message)"))
        elif isinstance(n, ast.Dict):
            keys = {k.value for k in n.keys if isinstance(k, ast.Constant)}
            if "op" in keys:
                out.append((n.lineno, "a trainer-ranks message {'op': ...}"))
            elif "call" in keys or ("enginehooks" in keys and keys & {"ok", "error"}) \
                    or keys == {"result"} or keys == {"error", "message"} \
                    or keys == {"group", "auth"}:
                out.append((n.lineno, f"envelope {sorted(map(str, keys))}"))
        elif isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) \
                and n.slice.value == "call":
            out.append((n.lineno, '["call"]'))
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and (
                n.value.startswith(("enginehooks-call", "[enginehooks-error"))
                or n.value == "X-Enginehooks-Auth"):
            out.append((n.lineno, repr(n.value)))
    return out


def test_the_protocol_module_is_the_only_place_payloads_and_envelopes_are_made() -> None:
    """What a token signs, what an answer's envelope holds, and each verb's arguments
    are built and read in one place, the wire package (`enginehooks/wire/`), so the
    trainer signs exactly what the worker verifies and every channel restores the same
    errors: an AST scan of the library for everything listed in `_PROTOCOL_ONLY`. The
    wire stands on its own floor: it imports nothing of `control/`, `engine/` or an
    engine's extension (which would let a message's form depend on one side)."""
    from pathlib import Path

    # The scan sees what it looks for (it must not pass by seeing nothing).
    probe = """
sign(key, "check", text)
canonical({"a": 1})
self.verifier.verify(verb, payload, token)
reply = {"enginehooks": 1, "call": cid, "ok": 1}
reply["call"]; reply.get("call")
out = {"error": "X", "message": "m"}
h = {"X-Enginehooks-Auth": t}
mark = "[enginehooks-error:"
leave = {"group": g, "auth": t}
self.call(CHECK, manifest, timeout_s=1)
class Go(channel.Message): pass
command = {"op": "send", "manifest": m}
"""
    assert len(_protocol_offences(probe)) == 13, _protocol_offences(probe)
    root = Path(__file__).resolve().parents[3] / "enginehooks"
    allowed = {root / "core" / "auth.py", *(root / "wire").glob("*.py")}
    offenders = [f"{p.relative_to(root)}:{line}: {what}" for p in sorted(root.rglob("*.py"))
                 if p not in allowed for line, what in _protocol_offences(p.read_text())]
    assert offenders == [], offenders
    from enginehooks_testkit.import_graph import edges

    above = ("enginehooks.control", "enginehooks.engine", "enginehooks.vllm_ext",
             "enginehooks.sglang_ext", "enginehooks.ray_ext")
    wire_up = sorted((m, d) for m, deps in edges(type_checking=True).items()
                     if m.startswith("enginehooks.wire") for d in deps
                     if d.startswith(above))
    assert wire_up == [], wire_up


def test_every_verb_has_a_typed_request_that_round_trips() -> None:
    """Each verb's request class builds the RPC's arguments (`args`) and decodes them
    back into the same request (`from_args`, what the worker runs), over JSON text."""
    from enginehooks.engine.contract import VERBS

    assert set(wire.REQUESTS) == set(VERBS)
    m = manifest()
    samples = [wire.InfoRequest(), wire.JoinRequest({"transport": "gloo"}, 1, "t"),
               wire.JoinRequest({"transport": "gloo"}, 3), wire.LeaveRequest(None),
               wire.LeaveRequest(wire.leave_message("g", "t")),
               wire.CheckRequest(m, "t"), wire.ReceiveRequest(m, "g"),
               wire.DigestsRequest(["a", "b"]), wire.FlushRequest("t")]
    for r in samples:
        sent = json.loads(json.dumps(list(r.args())))
        assert wire.REQUESTS[r.verb].from_args(sent) == r, r
    with pytest.raises(errors.ConfigError, match="takes 2 to 3 arguments"):
        wire.JoinRequest.from_args([{"transport": "gloo"}])
    with pytest.raises(errors.ConfigError, match="malformed argument"):
        wire.DigestsRequest.from_args(["[1, 2]"])
    assert wire.JoinRequest({"a": 1}, 1, "t").payload() == \
        wire.signed_payload("join", endpoint={"a": 1}, rank_offset=1)


class HeldLeaves(LocalEngine):
    """A replica behind a link that drops its `leave` calls for a while: the network
    holds them (TCP retransmits them once a partition heals), then delivers them after
    the next push's `join`, just before its `receive` (docs/transports.md, "Across
    hosts")."""

    def __init__(self, module: nn.Module, name: str) -> None:
        super().__init__(module, name=name)
        self.held: list[str | None] = []
        self.answers: list[Any] = []

    def leave(self, timeout_s: float, auth: str | None = None) -> None:
        self.held.append(auth)  # the link is down: not delivered yet

    def receive(self, manifest_json: str, group: str, timeout_s: float,
                auth: str | None = None) -> list[dict[str, Any]]:
        while self.held:  # the link healed: the old leaves arrive now, after the join
            self.answers += self.call("leave", *[a for a in [self.held.pop(0)] if a],
                                      timeout_s=timeout_s)
        return super().receive(manifest_json, group, timeout_s, auth)


@pytest.mark.parametrize("secret", [None, SECRET], ids=["open", "signed"])
def test_a_late_leave_of_an_old_group_leaves_the_current_group_intact(
        secret: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The leave of a closed group, delivered after the worker joined a new one, is
    ignored (answered `left: False`) instead of taking the worker out of the new group
    ("this worker has not joined a transport group"): the push that joined it lands."""
    if secret:
        monkeypatch.setenv(SECRET_ENV, secret)
    engine = HeldLeaves(net(0), name="held-leaves")
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with WeightSync("gloo", timeout_s=30, secret=secret) as sync:
        sync.add_replica(engine)
        assert sync.push(net(1), version=1).ok
        old_group = engine.side.group
        sync.close()  # e.g. after a failed push: its leave is held by the network
        assert len(engine.held) == 1 and engine.side.group == old_group
        src = net(2)
        assert sync.push(src, version=2).ok  # joins a new group; the old leave lands first
        assert engine.answers and engine.answers[0]["left"] is False, engine.answers
        assert engine.answers[0]["group"] == old_group
        assert engine.side.group not in (None, old_group) and engine.side.version == 2
        assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(),
                                                     engine.target.module.state_dict().values()))
        assert sync.push(net(3), version=3).ok  # the same group, still joined
    assert engine.side.version == 3


def test_a_leave_names_its_group_and_its_signature_covers_it(guarded: list[LocalEngine]) -> None:
    """A signed leave leaves the group it names; one for another group is answered
    `left: False` and changes nothing; rewriting a leave's group breaks its signature;
    a leave that names no group (vLLM's own `shutdown_weight_transfer_engine`) still
    leaves whatever group the worker is in."""
    a = guarded[0]
    key, aud = SECRET.encode(), [a.side.instance]
    with WeightSync("gloo", timeout_s=30, secret=SECRET) as sync:
        sync.add_replica(a)
        assert sync.push(net(1), version=1).ok
        group = a.side.group
        assert group

        def leave(g: str | None) -> str | None:
            return wire.leave_message(
                g, sign(key, "leave", wire.signed_payload("leave", group=g), aud))

        assert a.side.call("leave", leave("an-old-group")) == {
            "left": False, "group": "an-old-group",
            "reason": f"this worker is in group {group!r}, not 'an-old-group': a late leave "
                      "of an earlier group, ignored"}
        assert a.side.group == group
        forged = json.loads(leave("an-old-group") or "")
        forged["group"] = group
        with pytest.raises(AuthError, match="does not match"):
            a.side.call("leave", json.dumps(forged))
        assert a.side.group == group
        with pytest.raises(AuthError):
            a.side.call("leave", wire.leave_message(group, None))  # unsigned
        assert a.side.call("leave", leave(group)) == {"left": True, "group": group}
        assert a.side.group is None and a.side.receiver is None
        assert sync.push(net(2), version=2).ok  # rejoins
        assert a.side.call("leave", leave(None))["left"] is True
        assert a.side.group is None


class HostGone(LocalEngine):
    """A replica whose host disappears mid-push: it joined the group, and its receive
    never answers (until the test lets it go)."""

    def __init__(self, module: nn.Module, name: str) -> None:
        super().__init__(module, name=name)
        self.receiving, self.release = threading.Event(), threading.Event()

    def receive(self, manifest_json: str, group: str, timeout_s: float,
                auth: str | None = None) -> list[dict[str, Any]]:
        self.receiving.set()
        self.release.wait(60.0)
        raise errors.PushTimeout(f"{self.name}: did not answer")


class PeerClosed(LocalEngine):
    """A healthy replica that answers first, with what gloo says once the sender closed
    its connections after the other replica was lost."""

    def __init__(self, module: nn.Module, name: str, lost: HostGone) -> None:
        super().__init__(module, name=name)
        self.lost = lost

    def receive(self, manifest_json: str, group: str, timeout_s: float,
                auth: str | None = None) -> list[dict[str, Any]]:
        self.lost.receiving.wait(30.0)
        # what `transports.base.data_plane_error` makes of gloo's RuntimeError
        # (tests/library/core/test_errors.py checks it on a real gloo group)
        raise errors.PeerLost(
            "receive of bucket 0 failed: [gloo/transport/tcp/pair.cc:561] Connection closed "
            "by peer [10.78.0.1]:41234. This is typically caused by a remote worker crashing.")


def test_the_push_error_names_the_replica_that_was_lost_not_the_first_to_answer() -> None:
    """With two replicas and one lost mid-push, the healthy one reports first (its
    connection to the sender closed: a consequence); the error names the lost one,
    which never answered, and lists the other's error after it."""
    lost = HostGone(net(0), name="engine-b")
    healthy = PeerClosed(net(0), name="engine-a", lost=lost)
    try:
        t0 = time.monotonic()
        with WeightSync("gloo", timeout_s=3) as sync:
            sync.add_replica(healthy)
            sync.add_replica(lost)
            with pytest.raises(errors.ReplicaError) as got:
                sync.push(net(1), version=1)
        assert time.monotonic() - t0 < 30
    finally:
        lost.release.set()
    assert got.value.replica == "engine-b", got.value
    assert str(got.value).startswith("replica 'engine-b': receive"), got.value
    assert "'engine-a' meanwhile" in str(got.value) and "(a consequence)" in str(got.value)
    report = got.value.report
    assert report is not None and {r.name: r.ok for r in report.replicas} == {
        "engine-a": False, "engine-b": False}


def test_a_workers_info_answers_only_the_keys_its_typed_reply_declares() -> None:
    """`EngineSide.info` answers a `wire.WorkerInfo`: every key it sends (its own and
    the binding's) is declared there, with `authenticated` and `instance` present, so
    the typed reply says what travels, and it survives the JSON wire as it is."""
    import typing

    engine = LocalEngine(net(0), name="local")
    info = engine.side.info()
    declared = set(typing.get_type_hints(wire.WorkerInfo))
    assert set(info) <= declared, sorted(set(info) - declared)
    assert {"authenticated", "instance", "state", "version", "dtype"} <= set(info)
    (checked,) = wire.check_infos([json.loads(json.dumps(info))], "local", secret=False)
    assert checked == info


@pytest.mark.parametrize("transport", ["gloo", "disk"])
def test_a_workers_receive_answers_only_the_keys_its_typed_reply_declares(
        transport: str, tmp_path: Any) -> None:
    """`EngineSide.receive` answers a `wire.ReceiveReply`: the keys a built-in transport,
    the worker and the binding send are declared there (what `PushReport` carries per
    worker)."""
    import typing

    options = {"root": str(tmp_path)} if transport == "disk" else {}
    engine = LocalEngine(net(0), name="local")
    with WeightSync(transport, timeout_s=30, transport_options=options) as sync:
        sync.add_replica(engine)
        report = sync.push(net(1), version=1)
    declared = set(typing.get_type_hints(wire.ReceiveReply))
    (replica,) = report.replicas
    (reply,) = replica.stats["workers"]
    assert {"bytes", "seconds", "version"} <= set(reply) <= declared, sorted(reply)
