"""The one channel between trainer ranks (`trainer_side/channel.py`): its typed messages
round-trip through JSON (never pickle), anything else is refused, a lockstep flag fits
its fixed frame, and the channel's collectives carry them over a real gloo group. The
multi-rank behaviour (commands, lockstep flags between processes) is covered end to end
by tests/multihost/test_multi_sender.py and tests/vllm/test_trainer_sharded.py."""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from enginehooks.core.errors import TransportError
from enginehooks.core.manifest import TensorSpec
from enginehooks.trainer_side.channel import (
    FLAG_BYTES,
    Answer,
    Bye,
    Close,
    Connect,
    End,
    Go,
    MalformedMessage,
    Message,
    Open,
    Plan,
    Reuse,
    Send,
    Stop,
    TrainerRanks,
    frame,
    unframe,
)

MESSAGES: list[Message] = [
    Go(3, 10, 0xDEADBEEF, "bfloat16"), Go(0, 1, 0), Stop(4, "ManifestError: refused"),
    Plan("bfloat16", {"lm_head.weight": None, "router.bias": "float32"}), Plan(), Open(),
    Connect(5), Send('{"tensors": []}'), Close(), End(True), End(False, "boom"), Bye(),
    Answer(), Answer(ok=False, error="TransportError: x"),
    Answer(endpoint={"host": "10.0.0.2", "port": 5}, seconds=0.5, bytes=1024),
    Reuse("0f" * 16), Answer(ok=False, error="its sender's group is closed", broken=True),
    Answer.of_specs([TensorSpec("w", "float32", (2, 3))]),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_json(message: Message) -> None:
    text = message.to_json()
    assert text.startswith("{") and f'"op":"{message.op}"' in text
    again = Message.from_json(text)
    assert again == message and type(again) is type(message)


def test_answers_carry_specs_and_refuse_malformed_ones() -> None:
    specs = [TensorSpec("a", "bfloat16", (4,)), TensorSpec("b", "int64", ())]
    answer = Message.from_json(Answer.of_specs(specs).to_json())
    assert isinstance(answer, Answer) and answer.tensor_specs(1) == specs
    with pytest.raises(MalformedMessage, match="trainer rank 2 sent a malformed plan"):
        Answer(specs=[["a", "float32"]]).tensor_specs(2)


@pytest.mark.parametrize("raw", [b"", b"not json", b"[1, 2]", b'{"op": "nope"}', b'{"x": 1}',
                                 b'{"op": "connect"}', b'{"op": "go", "index": 1}',
                                 b'{"op": "connect", "world": "4"}',
                                 b'{"op": "connect", "world": true}',
                                 b'{"op": "end", "ok": 1}', b'{"op": "plan", "dtypes": []}',
                                 b"\x80\x04\x95 pickle"])
def test_anything_but_a_message_is_refused(raw: bytes) -> None:
    with pytest.raises(MalformedMessage):
        Message.from_json(raw)


def test_a_flag_fits_its_frame_and_a_long_reason_is_cut() -> None:
    for message in (Go(2**31, 2**31, 2**32 - 1, "float8_e4m3fn"), Stop(7, "short")):
        raw = frame(message)
        assert len(raw) == FLAG_BYTES and unframe(raw) == message
    long = Stop(12345, 'ManifestError: "quoted" \u00e9' * 100)
    raw = frame(long)
    got = unframe(raw)
    assert len(raw) == FLAG_BYTES and isinstance(got, Stop) and got.index == 12345
    assert got.reason and long.reason.startswith(got.reason)
    with pytest.raises(MalformedMessage, match="does not fit"):
        frame(Send("x" * FLAG_BYTES))
    with pytest.raises(MalformedMessage):
        unframe(b"\0" * FLAG_BYTES)


@pytest.fixture
def one_rank_group(tmp_path) -> Iterator[None]:  # type: ignore[no-untyped-def]
    """A real one-process gloo group (its collectives run, to itself)."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=_dt.timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank_group")
def test_the_channel_carries_messages_over_a_gloo_group() -> None:
    ranks = TrainerRanks(None, timeout_s=10)
    assert ranks.coordinator and ranks.size == 1 and ranks.broken is None
    assert ranks.broadcast(Send("m" * 20000)) == Send("m" * 20000)  # any size
    assert ranks.gather(Answer(seconds=1.5)) == [Answer(seconds=1.5)]
    assert ranks.gather_short(Answer(error="e" * 10)).result() == [Answer(error="e" * 10)]
    cut = ranks.gather_short(Answer(ok=True, error="x" * 20000)).result()
    assert len(cut) == 1 and not cut[0].ok  # too long for a short answer: an error
    assert ranks.flag(Stop(3, "why"), 10) == Stop(3, "why")
    ranks.broken = "a rank died"
    with pytest.raises(TransportError, match="broken since: a rank died"):
        ranks.broadcast(Bye())

