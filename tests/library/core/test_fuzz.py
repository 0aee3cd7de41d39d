"""Fuzzing what arrives from the network: manifests, bucket trailers, RPC arguments.
Whatever the input, the answer is a clear enginehooks error (never a crash of another
kind), the worker is never left torn, and a refusing engine stays on its version."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from enginehooks import EngineHooksError, ManifestError, wire
from enginehooks.core.buckets import TRAILER_BYTES, Unpacker, message_bytes
from enginehooks.core.manifest import Manifest, TensorSpec, plan
from enginehooks.engine.contract import PREFIX, VERBS
from enginehooks.engine.local import LocalEngine

SETTINGS = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
GOOD = plan([TensorSpec("a", "float32", (4, 3)), TensorSpec("b", "bfloat16", (70,)),
             TensorSpec("c", "int64", (2,))], weight_version=1, bucket_bytes=128)
GOOD_JSON = GOOD.to_json()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=30)


def mutate(text: str, rnd: random.Random) -> str:
    """A few random edits of valid JSON: the inputs closest to passing validation."""
    data = json.loads(text)
    for _ in range(rnd.randint(1, 4)):
        parts = [data["tensors"], data["buckets"]]
        target = rnd.choice([data] + [x for p in parts if isinstance(p, list) for x in p]
                            + [p for p in parts if isinstance(p, list)])
        if isinstance(target, dict) and target:
            key = rnd.choice(list(target))
            target[key] = rnd.choice([None, -1, 0, 2**63, "x", [], {}, [1, 2, 3, 4], 1.5, True])
        elif isinstance(target, list) and target:
            i = rnd.randrange(len(target))
            target[i] = rnd.choice([None, [0, 10**9, None], "bucket", []])
    return json.dumps(data)


@SETTINGS
@given(st.text(max_size=300))
def test_any_text_as_a_manifest_is_refused_clearly(text: str) -> None:
    with pytest.raises(ManifestError):  # 300 random characters are never a manifest
        Manifest.from_json(text)


@SETTINGS
@given(json_values)
def test_any_json_as_a_manifest_is_refused_clearly(value: Any) -> None:
    with pytest.raises(ManifestError):  # no format_version 1 with valid fields by chance
        Manifest.from_dict(value)


@SETTINGS
@given(st.integers(0, 2**32))
def test_mutated_manifests_are_refused_clearly_or_valid(seed: int) -> None:
    text = mutate(GOOD_JSON, random.Random(seed))
    try:
        m = Manifest.from_json(text)
    except ManifestError:
        return
    Manifest.from_json(m.to_json())  # what validation lets through round-trips


@SETTINGS
@given(st.binary(min_size=TRAILER_BYTES, max_size=TRAILER_BYTES), st.integers(0, 1))
def test_random_trailers_are_refused_clearly(trailer: bytes, index: int) -> None:
    index = min(index, len(GOOD.buckets) - 1)
    buf = torch.zeros(message_bytes(GOOD.buckets[index].nbytes), dtype=torch.uint8)
    buf[-TRAILER_BYTES:] = torch.frombuffer(bytearray(trailer), dtype=torch.uint8)
    with pytest.raises(EngineHooksError):  # 64 random bytes never carry the magic
        Unpacker(GOOD).verify(index, buf)


REPLICA = LocalEngine(nn.Linear(3, 4), name="fuzzed")
args = st.lists(st.one_of(st.text(max_size=80), json_values.map(json.dumps), st.just(GOOD_JSON),
                          st.integers()), max_size=4)


@SETTINGS
@given(st.sampled_from(VERBS), args)
def test_random_rpc_arguments_never_crash_nor_tear_the_engine(verb: str, rpc_args: list[Any]) -> None:
    side = REPLICA.side
    before = (side.version, side.state)
    # Untagged: an answer (info, digests, leave may answer anything) or an enginehooks
    # error; any other exception fails the test.
    try:
        REPLICA.rpc(PREFIX + verb, *rpc_args, timeout_s=5)
        untagged = None
    except EngineHooksError as e:
        untagged = type(e).__name__
    # Tagged: whatever the arguments, the answer is an envelope echoing the call id
    # (an error travels inside it, by class name), never an exception; and it is the
    # same outcome as the untagged call's.
    reply = REPLICA.side.call(verb, wire.call_arg("f00d"), *rpc_args)
    assert wire.is_envelope(reply) and reply["call"] == "f00d"
    assert (reply["error"]["type"] if "error" in reply else None) == untagged, reply
    if "error" in reply:
        assert issubclass(wire.error_classes()[reply["error"]["type"]], EngineHooksError)
    if verb in ("join", "leave"):  # joining a group is allowed to change membership only
        side.leave()
    assert (side.version, side.state) == before
