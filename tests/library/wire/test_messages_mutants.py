"""The trainer<->worker protocol's protective paths (`wire/`), pinned where
mutation testing found them loose (issue 26 item 2; docs/testing.md, third run): what
each verb signs, the checks of tokens and signed routes, call ids, typed requests'
decoding, a leave's message, replies and envelopes, a join's world and the workers'
`info` answers."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import pytest

from enginehooks import wire as p
from enginehooks.core.auth import AuthError, Verifier, canonical, sign
from enginehooks.core.deadline import Deadline
from enginehooks.core.errors import (
    ChecksumError,
    ConfigError,
    EngineHooksError,
    EngineTorn,
    PushTimeout,
    ReplicaError,
)
from enginehooks.wire import requests as wire_requests

SECRET = b"s" * 32


# -- signed payloads ------------------------------------------------------------------------
def test_each_verb_signs_exactly_its_own_fields() -> None:
    ep = {"host": "h", "port": 1}
    assert p.signed_payload("join", endpoint=ep, rank_offset=3) == canonical(
        {"endpoint": ep, "rank_offset": 3}) == '{"endpoint":{"host":"h","port":1},"rank_offset":3}'
    assert p.signed_payload("check", manifest='{"b": 1, "a": 2}') == '{"a":2,"b":1}'
    # receive signs the manifest's text as it travels (the worker parses that same text)
    assert p.signed_payload("receive", manifest='{"m": 1}', group="g") == (
        '{"group":"g","manifest":"{\\"m\\": 1}"}')
    assert p.signed_payload("leave", group="g1") == '{"group":"g1"}'
    # a leave that names no group signs what a leave signed before groups were named
    assert p.signed_payload("leave") == p.signed_payload("leave", group=None) == ""
    assert p.signed_payload("flush") == ""
    with pytest.raises(ConfigError) as e:
        p.signed_payload("digests", names=[])
    assert str(e.value) == "verb 'digests' is not signed"


def test_a_token_verifies_for_its_verb_and_fields_only() -> None:
    v = Verifier(SECRET)
    t = p.token(SECRET, "receive", manifest='{"m": 1}', group="g")
    p.verify_token(v, "receive", t, manifest='{"m": 1}', group="g")
    for verb, fields in [("receive", {"manifest": '{"m": 2}', "group": "g"}),
                         ("receive", {"manifest": '{"m": 1}', "group": "h"}),
                         ("check", {"manifest": '{"m": 1}'})]:
        with pytest.raises(AuthError):
            p.verify_token(Verifier(SECRET), verb, t, **fields)
    with pytest.raises(AuthError):
        p.verify_token(Verifier(SECRET), "receive",
                       p.token(b"x" * 32, "receive", manifest='{"m": 1}', group="g"),
                       manifest='{"m": 1}', group="g")


def test_a_token_carries_its_audience() -> None:
    t = p.token(SECRET, "flush", audience=["worker-b", "worker-a"])
    assert json.loads(t)["aud"] == ["worker-a", "worker-b"]
    p.verify_token(Verifier(SECRET, audience="worker-a"), "flush", t)
    with pytest.raises(AuthError):
        p.verify_token(Verifier(SECRET, audience="worker-c"), "flush", t)


# -- signed HTTP routes ---------------------------------------------------------------------
def test_a_route_signs_method_path_query_and_body_never_a_host() -> None:
    body = b'{"x": 1}'
    assert p.route_payload("post", "/pause", "a=1", body) == canonical({
        "method": "POST", "path": "/pause", "query": "a=1",
        "body": hashlib.sha256(body).hexdigest()})


def test_route_headers_sign_what_verify_route_checks_for_one_server() -> None:
    body = {"tags": ["weights"]}
    h = p.route_headers(SECRET, "http://Engine:8000/sleep?level=1", body, "server-a")
    assert list(h) == [p.ROUTE_AUTH_HEADER] == ["X-Enginehooks-Auth"]
    assert json.loads(h[p.ROUTE_AUTH_HEADER])["aud"] == ["server-a"]
    raw = json.dumps(body).encode()
    p.verify_route(Verifier(SECRET, audience="server-a"), "POST", "/sleep", "level=1", raw,
                   h[p.ROUTE_AUTH_HEADER])
    # a text secret is the same key as its bytes
    h2 = p.route_headers(SECRET.decode(), "http://engine:8000/sleep?level=1", body, "server-a")
    p.verify_route(Verifier(SECRET, audience="server-a"), "POST", "/sleep", "level=1", raw,
                   h2[p.ROUTE_AUTH_HEADER])
    for change in [dict(method="GET"), dict(path="/wake_up"), dict(query="level=2"),
                   dict(body=b"{}")]:
        args = dict(method="POST", path="/sleep", query="level=1", body=raw) | change
        with pytest.raises(AuthError):
            p.verify_route(Verifier(SECRET, audience="server-a"), args["method"], args["path"],
                           args["query"], args["body"], h[p.ROUTE_AUTH_HEADER])
    # another server (whatever Host header the request carries: none is read) refuses it
    with pytest.raises(AuthError, match="signed for another replica"):
        p.verify_route(Verifier(SECRET, audience="server-b"), "POST", "/sleep", "level=1", raw,
                       h2[p.ROUTE_AUTH_HEADER])
    # a token that names no server is refused by every server
    nameless = p.route_headers(SECRET, "http://engine:8000/sleep?level=1", body)
    with pytest.raises(AuthError, match="signed for another replica"):
        p.verify_route(Verifier(SECRET, audience="server-a"), "POST", "/sleep", "level=1", raw,
                       nameless[p.ROUTE_AUTH_HEADER])
    # the route verb is its own: a token of another verb over the same text is refused
    other = sign(SECRET, "flush", p.route_payload("POST", "/sleep", "level=1", raw),
                 audience=["server-a"])
    with pytest.raises(AuthError):
        p.verify_route(Verifier(SECRET, audience="server-a"), "POST", "/sleep", "level=1", raw,
                       other)


def test_a_servers_identity_is_signed_over_the_clients_nonce() -> None:
    answer = p.identity_answer(SECRET, "server-a", "n1")
    assert p.read_identity(SECRET, answer, "n1") == "server-a"
    with pytest.raises(AuthError, match="another request"):
        p.read_identity(SECRET, answer, "n2")  # an answer replayed to another request
    with pytest.raises(AuthError, match="not signed with the shared secret"):
        p.read_identity(SECRET, dict(answer, server="server-b"), "n1")  # a swapped identity
    with pytest.raises(AuthError, match="not signed with the shared secret"):
        p.read_identity(SECRET, p.identity_answer(b"other", "server-a", "n1"), "n1")
    # a server without a secret checks no token: what the client signs for is moot
    assert p.read_identity(SECRET, p.identity_answer(None, "server-a", "n1"), "n1") == "server-a"
    with pytest.raises(AuthError, match="not signed with the shared secret"):
        p.read_identity(SECRET, dict(answer, mac="0" * 64), "n1")
    # a client without a secret signs nothing and checks nothing
    assert p.read_identity(None, p.identity_answer(None, "server-a", "n1"), "n1") == "server-a"
    for bad in (None, [], {"server": "", "nonce": "n1"}, {"server": 5, "nonce": "n1"}):
        with pytest.raises(AuthError, match="malformed"):
            p.read_identity(SECRET, bad, "n1")


def test_a_servers_processes_share_one_replay_window(tmp_path: Any) -> None:
    """Two API processes of one server (two verifiers over one nonce folder): a token
    used at one is a replay at the other."""
    from enginehooks.core.auth import NonceStore

    a = Verifier(SECRET, audience="server-a", nonces=NonceStore(tmp_path / "n"))
    b = Verifier(SECRET, audience="server-a", nonces=NonceStore(tmp_path / "n"))
    raw = b"{}"
    h = p.route_headers(SECRET, "http://x/pause", {}, "server-a")[p.ROUTE_AUTH_HEADER]
    p.verify_route(a, "POST", "/pause", "", raw, h)
    with pytest.raises(AuthError, match="replay"):
        p.verify_route(b, "POST", "/pause", "", raw, h)
    assert not NonceStore(tmp_path / "n").first_use("../escape")  # only hex nonces name files


@pytest.mark.parametrize("secret", [None, b"", ""])
def test_no_secret_no_route_header(secret: Any) -> None:
    assert p.route_headers(secret, "http://e:1/x", {}) == {}


# -- call ids -----------------------------------------------------------------------------
def test_split_call_takes_the_call_id_off_the_front() -> None:
    assert p.call_arg("abc") == "enginehooks-call:abc"
    assert p.split_call(["enginehooks-call:abc1", 1, "x"]) == ("abc1", (1, "x"))
    assert p.split_call(["enginehooks-call:" + "a" * 64]) == ("a" * 64, ())
    assert p.split_call([1, "enginehooks-call:abc"]) == (None, (1, "enginehooks-call:abc"))
    assert p.split_call(["other", 2]) == (None, ("other", 2))
    assert p.split_call([]) == (None, ())
    cid = p.new_call_id()
    assert len(cid) == 32 and cid.isalnum() and p.new_call_id() != cid
    assert p.split_call([p.call_arg(cid)]) == (cid, ())


@pytest.mark.parametrize("bad", ["", "a" * 65, "a-b", "a b", "ab\n"])
def test_a_malformed_call_id_is_refused(bad: str) -> None:
    arg = "enginehooks-call:" + bad
    with pytest.raises(ConfigError) as e:
        p.split_call([arg, 1])
    assert str(e.value) == f"malformed call id {arg[:80]!r}"


# -- envelopes and replies -------------------------------------------------------------------
def test_envelopes_answer_only_their_call() -> None:
    assert p.ok("c1", 5) == {"enginehooks": 1, "call": "c1", "ok": 5}
    e = p.err("c1", ChecksumError("bad" + "x" * 30000))
    assert e["enginehooks"] == 1 and e["call"] == "c1"
    assert e["error"]["type"] == "ChecksumError" and len(e["error"]["message"]) == 20000
    assert p.answers(p.ok("c1", None), "c1")
    assert not p.answers(p.ok("c2", None), "c1")
    assert not p.answers({"enginehooks": 2, "call": "c1"}, "c1")
    assert not p.answers({"enginehooks": 1}, "c1")
    assert not p.is_envelope(["enginehooks", 1, "call"])
    assert not p.is_envelope({"call": "c1", "ok": 1})
    assert p.is_envelope({"enginehooks": 1, "call": None})


def test_unwrap_takes_the_result_restores_the_error_and_refuses_strangers() -> None:
    assert p.unwrap(p.ok("c", {"a": 1}), "c", "r0") == {"a": 1}
    assert p.unwrap({"enginehooks": 1, "call": "c"}, "c", "r0") is None
    with pytest.raises(p.StaleReply) as s:
        p.unwrap(p.ok("other", 1), "c", "r0")
    assert str(s.value) == "r0: the answer to call 'other', not 'c'"
    with pytest.raises(p.StaleReply) as s:
        p.unwrap({"ok": 1}, "c", "r0")
    assert str(s.value) == "r0: an answer without a call id ({'ok': 1})"
    with pytest.raises(ChecksumError) as c:
        p.unwrap(p.err("c", ChecksumError("bucket 3")), "c", "r1")
    assert str(c.value) == "bucket 3" and c.value.replica == "r1"
    # an error that is not an object: a ReplicaError, not a crash
    with pytest.raises(ReplicaError) as r:
        p.unwrap({"enginehooks": 1, "call": "c", "error": "boom"}, "c", "r2")
    assert r.value.replica == "r2"


def test_read_reply_restores_enginehooks_errors_and_wraps_the_rest() -> None:
    assert p.read_reply(p.result_reply([1]), "r", "push") == [1]
    assert p.read_reply({"result": None, "error": "x"}, "r", "push") is None
    with pytest.raises(ChecksumError) as c:
        p.read_reply(p.error_reply(ChecksumError("d")), "r0", "push")
    assert str(c.value) == "d" and c.value.replica == "r0"
    with pytest.raises(ReplicaError) as r:
        p.read_reply(p.error_reply(KeyError("k")), "r0", "push")
    assert "push failed in the actor: KeyError: 'k'" in str(r.value)
    with pytest.raises(ReplicaError) as r:
        p.read_reply({"error": "ReplicaError", "message": "m"}, "r0", "leave")
    assert "leave failed in the actor: ReplicaError: m" in str(r.value)
    with pytest.raises(ReplicaError) as r:
        p.read_reply(["nope"], "r0", "info")
    assert "info: the actor answered ['nope']" in str(r.value)
    assert p.error_reply(ValueError("v" * 30000)) == {"error": "ValueError",
                                                       "message": "v" * 20000}


def test_restore_error_keeps_the_class_and_names_the_replica() -> None:
    e = p.restore_error("PushTimeout", "slow", "r3")
    assert type(e) is PushTimeout and str(e) == "slow" and e.replica == "r3"
    t = p.restore_error("EngineTorn", "half applied", "r3")
    assert type(t) is EngineTorn and t.replica == "r3"
    u = p.restore_error("OSError", "disk", "r3")
    assert type(u) is ReplicaError and "OSError: disk" in str(u) and u.replica == "r3"
    r = p.restore_error("ReplicaError", "as is", "r3")
    assert type(r) is ReplicaError and "as is" in str(r) and "ReplicaError:" not in str(r)
    classes = p.error_classes()
    assert classes["EngineHooksError"] is EngineHooksError
    assert classes["ChecksumError"] is ChecksumError and classes["StaleReply"] is p.StaleReply
    assert all(issubclass(c, EngineHooksError) and c.__name__ == n for n, c in classes.items())


# -- typed requests ------------------------------------------------------------------------
def test_requests_decode_text_and_objects_alike() -> None:
    j = p.JoinRequest.from_args(['{"host": "h"}', "2", "tok"])
    assert j == p.JoinRequest({"host": "h"}, 2, "tok")
    assert p.JoinRequest.from_args([{"host": "h"}, 2]) == p.JoinRequest({"host": "h"}, 2, None)
    assert j.args() == ('{"host": "h"}', 2, "tok")
    assert p.JoinRequest({"host": "h"}, 2).args() == ('{"host": "h"}', 2)
    assert j.payload() == p.signed_payload("join", endpoint={"host": "h"}, rank_offset=2)
    r = p.ReceiveRequest.from_args(['{"m":1}', "g"])
    assert r.payload() == p.signed_payload("receive", manifest='{"m":1}', group="g")
    c = p.CheckRequest.from_args([{"m": 1}, "null"])
    assert c == p.CheckRequest('{"m": 1}', None)
    assert c.payload() == p.signed_payload("check", manifest='{"m": 1}')
    assert p.DigestsRequest.from_args(['["a", "b"]']).names == ["a", "b"]
    assert p.FlushRequest.from_args([]).args() == ()
    assert p.LeaveRequest.from_args(["None"]) == p.LeaveRequest(None)
    assert p.LeaveRequest.from_args([""]) == p.LeaveRequest(None)
    assert p.LeaveRequest.from_args([{"auth": 1}]) == p.LeaveRequest('{"auth": 1}')
    assert p.InfoRequest.from_args([]) == p.InfoRequest()
    assert set(p.REQUESTS) == {"info", "join", "leave", "check", "receive", "digests", "flush"}
    assert all(cls.verb == verb for verb, cls in p.REQUESTS.items())


@pytest.mark.parametrize("cls,args", [
    (p.JoinRequest, ['{"h": 1}']),                       # too few
    (p.JoinRequest, ['{"h": 1}', 1, "t", "extra"]),      # too many
    (p.InfoRequest, ["true", "x"]),
    (p.ReceiveRequest, ["{}"]),
    (p.DigestsRequest, []),
])
def test_a_request_with_the_wrong_number_of_arguments_is_refused(cls: Any, args: list) -> None:
    with pytest.raises(ConfigError) as e:
        cls.from_args(args)
    assert str(e.value) == (f"enginehooks_{cls.verb} takes {cls.required} to "
                            f"{len(cls.decoders)} arguments, got {len(args)}")


@pytest.mark.parametrize("cls,args,why", [
    (p.JoinRequest, ["[1]", 1], "ValueError: expected a JSON object, got list"),
    (p.JoinRequest, ["{}", True], "ValueError: expected an integer, got bool"),
    (p.JoinRequest, ["{}", 1.5], "ValueError: expected an integer, got float"),
    (p.JoinRequest, ["{}", "x"], "ValueError: invalid literal for int() with base 10: 'x'"),
    (p.JoinRequest, ["not json", 1], "JSONDecodeError"),
    (p.DigestsRequest, ['["a", 1]'], "ValueError: expected a JSON list of tensor names"),
    (p.DigestsRequest, ['{"a": 1}'], "ValueError: expected a JSON list of tensor names"),
])
def test_a_malformed_argument_is_refused_as_config_not_a_crash(cls: Any, args: list,
                                                               why: str) -> None:
    with pytest.raises(ConfigError) as e:
        cls.from_args(args)
    assert str(e.value).startswith(f"enginehooks_{cls.verb}: malformed argument (")
    assert why in str(e.value)


def test_decoders() -> None:
    assert wire_requests._int("7") == 7 and wire_requests._int(7) == 7
    assert wire_requests._text("t") == "t" and wire_requests._text({"a": 1}) == '{"a": 1}'
    assert wire_requests._json_value(b'{"a": 1}') == {"a": 1} and wire_requests._json_value([1]) == [1]
    for v in (None, "", "None", "null"):
        assert wire_requests._token(v) is None
    assert wire_requests._token("tok") == "tok" and wire_requests._token({"m": 1}) == '{"m": 1}'
    assert wire_requests._names(["a"]) == ["a"]
    assert wire_requests._object({"a": 1}) == {"a": 1}


# -- leave ----------------------------------------------------------------------------------
def test_a_leave_message_names_its_group_and_parses_back() -> None:
    assert p.leave_message(None, "tok") == "tok" and p.leave_message(None, None) is None
    msg = p.leave_message("g1", "tok")
    assert json.loads(msg) == {"group": "g1", "auth": "tok"}
    assert p.parse_leave(msg) == ("g1", "tok")
    assert p.parse_leave(msg.encode()) == ("g1", "tok")
    assert p.parse_leave(p.leave_message("g1", None)) == ("g1", None)
    assert p.parse_leave({"group": "g2", "auth": {"nonce": "n"}}) == ("g2", '{"nonce": "n"}')
    assert p.parse_leave({"group": "g" * 4096}) == ("g" * 4096, None)


def test_a_leave_without_a_group_is_a_bare_token() -> None:
    assert p.parse_leave(None) == (None, None)
    assert p.parse_leave("tok-not-json") == (None, "tok-not-json")
    tok = p.token(SECRET, "leave")
    assert p.parse_leave(tok) == (None, tok)  # a token is JSON, but names no group
    assert p.parse_leave("[1, 2]") == (None, "[1, 2]")
    assert p.parse_leave(b"\xff") == (None, "\ufffd")


@pytest.mark.parametrize("group", ["", 5, None, ["g"], "g" * 4097])
def test_a_leave_naming_a_bad_group_is_refused(group: Any) -> None:
    with pytest.raises(ConfigError) as e:
        p.parse_leave(json.dumps({"group": group, "auth": "t"}))
    assert str(e.value) == f"a leave names its group as a non-empty string, not {group!r:.200}"


@pytest.mark.parametrize("auth", [5, ["t"], True])
def test_a_leave_whose_token_is_not_text_is_refused(auth: Any) -> None:
    with pytest.raises(ConfigError) as e:
        p.parse_leave(json.dumps({"group": "g", "auth": auth}))
    assert str(e.value) == f"a leave's token is JSON text, not {type(auth).__name__}"


# -- join ----------------------------------------------------------------------------------
def test_check_world_accepts_the_last_rank_and_refuses_the_next() -> None:
    p.check_world(4, 1, 2, 3, 3)       # rank 3 of world 4
    p.check_world(2, 1, 0, None, None)  # the smallest group
    p.check_world(None, 50, 0, None, 2)
    with pytest.raises(ConfigError) as e:
        p.check_world(4, 1, 3, None, None)  # rank 4 of world 4
    assert str(e.value).startswith("join refused: this worker would be rank 4 of a group of "
                                   "world_size 4, which has room for ranks 1..3 only; ")
    assert str(e.value).endswith(p.WORLD_FIX)


@pytest.mark.parametrize("world", [1, 0, True, "4", 4.0])
def test_check_world_refuses_a_world_that_is_not_an_int_of_two_or_more(world: Any) -> None:
    with pytest.raises(ConfigError) as e:
        p.check_world(world, 0, 0, None, None)
    assert str(e.value) == (f"join refused: world_size {world!r} is not an int >= 2; "
                            f"{p.WORLD_FIX}")


def test_check_world_refuses_a_miscounted_replica() -> None:
    with pytest.raises(ConfigError) as e:
        p.check_world(8, 1, 0, 2, 4)
    assert str(e.value) == ("join refused: the trainer counts 4 worker(s) for this replica, "
                            f"which runs 2: set world_size to 3 for one replica; {p.WORLD_FIX}")
    p.check_world(8, 1, 0, 2, None)
    p.check_world(8, 1, 0, None, 4)


# -- info -----------------------------------------------------------------------------------
def test_check_infos_needs_the_authenticated_field() -> None:
    good = [{"authenticated": True, "rank": 0}, {"authenticated": None}]
    assert p.check_infos(good, "r0", secret=True) == good
    for bad in ([{"rank": 0}], ["text"], [None]):
        with pytest.raises(ConfigError) as e:
            p.check_infos(bad, "r0", secret=False)
        assert str(e.value).startswith("replica 'r0': a worker's info does not say whether "
                                       f"it verifies signed updates ({str(bad[0])[:200]})")


def test_with_a_secret_a_worker_without_one_is_refused() -> None:
    infos = [{"authenticated": True}, {"authenticated": False}]
    assert p.check_infos(infos, "r0", secret=False) == infos
    with pytest.raises(AuthError) as e:
        p.check_infos(infos, "r0", secret=True)
    assert str(e.value).startswith("replica 'r0' runs without the shared secret and would "
                                   "accept anyone's push")


# -- deadline -------------------------------------------------------------------------------
def test_a_deadline_counts_down_and_says_what_was_late() -> None:
    d = Deadline.after(30)
    assert d.seconds == 30.0 and 29 < d.left() <= 30 and not d.expired
    d.check("join")  # no refusal before the deadline
    past = Deadline(time.monotonic() - 1, 5)
    assert past.expired and past.left() == 0.0 and past.left(0.5) == 0.5
    with pytest.raises(PushTimeout) as e:
        past.check("join of r0")
    assert str(e.value) == "join of r0: no answer within 5s"
    assert Deadline(time.monotonic(), 0).expired  # the deadline itself is late


# -- what the trainer reads back: exact texts (fourth mutation run) ---------------------------
def test_replies_name_their_replica_and_keep_the_engines_words_exactly() -> None:
    """A replica's answer becomes an error that names the replica and carries what the
    engine said, and nothing it did not say. Fourth mutation run (docs/testing.md): the
    defaults for an error without a message or a type ("" and "ReplicaError"), the
    cut of a stranger's answer at 200 characters, `and` for `or` in "is it an error
    object", the torn refusal's state, and the fallback for an error class with another
    constructor all survived, since the tests matched parts of the text only."""
    from enginehooks.trainer_side.lockstep import PushAborted

    # read_reply (Ray actors): an error without a message; text that is not an object
    with pytest.raises(ReplicaError) as r:
        p.read_reply({"error": "KeyError"}, "r0", "push")
    assert str(r.value) == "replica 'r0': push failed in the actor: KeyError: "
    assert r.value.replica == "r0"
    with pytest.raises(ReplicaError) as r:
        p.read_reply("an error", "r1", "info")
    assert str(r.value) == "replica 'r1': info: the actor answered 'an error'"
    assert r.value.replica == "r1"
    # unwrap (envelopes): an error object without type or message; a long stranger
    with pytest.raises(ReplicaError) as r:
        p.unwrap({"enginehooks": 1, "call": "c", "error": {}}, "c", "r2")
    assert str(r.value) == "replica 'r2': " and r.value.replica == "r2"
    with pytest.raises(ReplicaError) as r:
        p.unwrap({"enginehooks": 1, "call": "c", "error": {"type": "OSError"}}, "c", "r2")
    assert str(r.value) == "replica 'r2': OSError: "
    stranger = {"x": "y" * 300}
    with pytest.raises(p.StaleReply) as s:
        p.unwrap(stranger, "c", "r2")
    assert str(s.value) == f"r2: an answer without a call id ({str(stranger)[:200]})"
    # restore_error: a torn refusal says torn; a class the protocol cannot rebuild from
    # its message alone becomes a ReplicaError that keeps the class name and the message
    t = p.restore_error("EngineTorn", "half applied", "r3")
    assert t.refusal == {"error": "half applied", "state": "torn"}  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        PushAborted("m")  # type: ignore[call-arg]
    a = p.restore_error("PushAborted", "the trainer left", "r3")
    assert type(a) is ReplicaError and a.replica == "r3"
    assert str(a) == "replica 'r3': PushAborted: the trainer left"


def test_check_infos_refusals_say_the_fix_exactly() -> None:
    """The two refusals of `check_infos` end with the fix, word for word (fourth
    mutation run: their last sentences could change case unseen)."""
    with pytest.raises(ConfigError) as e:
        p.check_infos([{"rank": 0}], "r0", secret=False)
    assert str(e.value).endswith("): run the same enginehooks version on the trainer and "
                                 "the engines")
    with pytest.raises(AuthError) as a:
        p.check_infos([{"authenticated": False}], "r0", secret=True)
    assert str(a.value) == (
        "replica 'r0' runs without the shared secret and would accept anyone's push: set "
        "ENGINEHOOKS_SECRET or ENGINEHOOKS_SECRET_FILE in its environment too "
        "(docs/security.md)")
