"""Tests that kill the mutants `make mutants` found surviving in core/auth.py
(docs/testing.md): the bucket MAC's exact input, token shapes the verifier accepts and
refuses at their bounds, the freshness window at its edge, the replay memory's pruning,
and the refusal texts an operator reads."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging

import pytest

from enginehooks.core import auth
from enginehooks.core.auth import AuthError, Verifier, _mac, bucket_mac, canonical, sign

SECRET = b"s3cret"


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(auth.time, "time", lambda: now[0])
    return now


def test_the_bucket_mac_covers_exactly_identity_and_digest() -> None:
    d = hmac.new(SECRET, b"enginehooks-bucket/1 7 2 100 -5", hashlib.sha256).digest()
    assert bucket_mac(SECRET, 7, 2, 100, -5) == (int.from_bytes(d[:8], "little", signed=True),
                                                  int.from_bytes(d[8:16], "little", signed=True))


def test_tokens_carry_a_128_bit_nonce_and_bytes_that_are_not_json_sign_as_text() -> None:
    assert len(json.loads(sign(SECRET, "check", "{}"))["nonce"]) == 32
    assert canonical(b"not json") == "not json"


def test_a_token_as_an_object_is_accepted_and_one_without_an_audience_is_not(
        clock: list[float]) -> None:
    """A token must name the side that verifies it (issue 36: one that names nobody
    could be replayed to every replica that shares the secret); a verifier without an
    audience (tools) takes any."""
    v = Verifier(SECRET, audience="w1")
    v.verify("check", "{}", json.loads(sign(SECRET, "check", "{}", ["w1"])))
    mac = _mac(SECRET, "check", "n1", 1000.0, "{}", ["w1"])
    v.verify("check", "{}", {"nonce": "n1", "ts": 1000.0, "mac": mac, "aud": ["w1"]})
    with pytest.raises(AuthError, match="signed for another replica"):
        v.verify("check", "{}", sign(SECRET, "check", "{}"))
    mac = _mac(SECRET, "check", "n2", 1000.0, "{}", [])
    with pytest.raises(AuthError, match="signed for another replica"):
        v.verify("check", "{}", {"nonce": "n2", "ts": 1000.0, "mac": mac})
    Verifier(SECRET).verify("check", "{}", sign(SECRET, "check", "{}"))
    # a verifier answers to several names (a worker's own id and its deployment's)
    both = Verifier(SECRET, audience=["w1", "deployment-7"])
    both.verify("check", "{}", sign(SECRET, "check", "{}", ["deployment-7"]))
    both.verify("check", "{}", sign(SECRET, "check", "{}", ["w1"]))


def test_the_audience_list_is_capped_at_4096_names(clock: list[float]) -> None:
    v = Verifier(SECRET, audience="w1")
    v.verify("check", "{}", sign(SECRET, "check", "{}", [f"w{i}" for i in range(4096)]))
    with pytest.raises(AuthError) as e:
        v.verify("check", "{}", sign(SECRET, "check", "{}", [f"w{i}" for i in range(4097)]))
    assert str(e.value) == "check refused: no valid authentication token (TypeError)"
    token = json.loads(sign(SECRET, "check", "{}"))
    token["aud"] = "w1"  # not a list
    with pytest.raises(AuthError, match=r"no valid authentication token \(TypeError\)"):
        v.verify("check", "{}", token)


def test_each_refusal_says_why_and_is_logged(clock: list[float],
                                             caplog: pytest.LogCaptureFixture) -> None:
    v = Verifier(SECRET, audience="w9")
    cases = [
        (sign(b"other", "check", "{}"), "the authentication token does not match (wrong "
         "secret or altered message)"),
        (sign(SECRET, "check", "{}", ["a", "b", "c", "d", "e"]), "the authentication token "
         "was signed for another replica (audience ['a', 'b', 'c', 'd'], this worker is 'w9')"),
        (sign(SECRET, "check", "{}", ["w9"], ts=100.0), "the authentication token is 900s old "
         "(window 300s)"),
    ]
    token = sign(SECRET, "check", "{}", ["w9"])
    v.verify("check", "{}", token)
    cases.append((token, "the authentication token was already used (replay)"))
    for bad, why in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="enginehooks.auth"), \
                pytest.raises(AuthError) as e:
            v.verify("check", "{}", bad)
        assert str(e.value) == f"check refused: {why}"
        assert [r.getMessage() for r in caplog.records] == [
            f"enginehooks: refused an unauthenticated check: {why}"]


def test_the_window_is_inclusive_at_its_edge(clock: list[float]) -> None:
    v = Verifier(SECRET)
    v.verify("check", "{}", sign(SECRET, "check", "{}", ts=700.0))
    v.verify("check", "{}", sign(SECRET, "check", "{}", ts=1300.0))
    with pytest.raises(AuthError, match="301s old"):
        v.verify("check", "{}", sign(SECRET, "check", "{}", ts=699.0))


def test_nonces_are_forgotten_oldest_first_after_twice_the_window(clock: list[float]) -> None:
    v = Verifier(SECRET)
    tokens = []
    for t in (1000.0, 1300.0):
        clock[0] = t
        tokens.append(sign(SECRET, "check", "{}"))
        v.verify("check", "{}", tokens[-1])
    first, second = (json.loads(t)["nonce"] for t in tokens)
    clock[0] = 1600.0  # the first nonce is exactly 2 windows old: still remembered
    v.verify("check", "{}", sign(SECRET, "check", "{}"))
    assert first in v._seen
    clock[0] = 1601.0  # now older than 2 windows: forgotten; the second is kept
    v.verify("check", "{}", sign(SECRET, "check", "{}"))
    assert first not in v._seen and second in v._seen and len(v._seen) == 3


def test_the_signed_text_is_key_sorted_compact_json() -> None:
    assert canonical('{"b": 1, "a": [1, 2]}') == '{"a":[1,2],"b":1}'
    assert canonical({"b": {"d": 1, "c": 2}}) == '{"b":{"c":2,"d":1}}'


def test_a_nameless_token_is_taken_only_where_the_caller_allows_it(clock: list[float]) -> None:
    """`anonymous_ok` (vLLM's own weight-transfer path) takes a token that names nobody,
    never one that names another worker."""
    v = Verifier(SECRET, audience="w1")
    v.verify("check", "{}", sign(SECRET, "check", "{}"), anonymous_ok=True)
    with pytest.raises(AuthError, match="signed for another replica"):
        v.verify("check", "{}", sign(SECRET, "check", "{}", ["w2"]), anonymous_ok=True)
    with pytest.raises(AuthError, match="signed for another replica"):
        v.verify("check", "{}", sign(SECRET, "check", "{}"))
