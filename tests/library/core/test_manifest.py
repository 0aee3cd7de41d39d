"""Manifest planning, JSON round trip, and validation errors that name the culprit."""

from __future__ import annotations

import json

import pytest

from enginehooks.core.errors import ManifestError
from enginehooks.core.manifest import ALIGN, Manifest, TensorSpec, plan


def specs() -> list[TensorSpec]:
    return [
        TensorSpec("a", "float32", (10, 10)),  # 400 B
        TensorSpec("big", "bfloat16", (3000,)),  # 6000 B > bucket: split
        TensorSpec("c", "int64", (3,)),
        TensorSpec("empty", "float16", (0, 4)),
    ]


def test_plan_splits_large_tensors_and_aligns() -> None:
    m = plan(specs(), weight_version=3, bucket_bytes=1024)
    big = m.tensors[1]
    assert len(big.pieces) == 6 and sum(p.nbytes for p in big.pieces) == 6000
    assert all(p.offset == 0 for p in big.pieces)  # each piece opens a bucket
    for t in m.tensors:
        for p in t.pieces:
            assert p.offset % ALIGN == 0 and p.offset + p.nbytes <= m.buckets[p.bucket].nbytes
    assert all(b.nbytes <= 1024 for b in m.buckets)
    assert m.tensors[3].pieces == () and m.total_bytes == 400 + 6000 + 24


def test_unsplit_plan_gives_large_tensor_its_own_bucket() -> None:
    m = plan(specs(), weight_version=3, bucket_bytes=1024, split=False)
    assert len(m.tensors[1].pieces) == 1 and m.buckets[m.tensors[1].pieces[0].bucket].nbytes == 6000
    assert Manifest.from_json(m.to_json()) == m


def test_json_round_trip_is_exact() -> None:
    m = plan(specs(), weight_version="step-7", bucket_bytes=2048, meta={"transport": "gloo"})
    assert Manifest.from_json(m.to_json()) == m


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(format_version=99), "format_version 99"),
        (lambda d: d["tensors"][0].update(dtype="complex64"), "tensor 'a': unsupported dtype"),
        (lambda d: d["tensors"][0].update(shape=[10, 11]), "tensor 'a': pieces carry 400 bytes"),
        (lambda d: d["tensors"][2]["pieces"][0].__setitem__(0, 99), "tensor 'c': piece names bucket 99"),
        (lambda d: d["tensors"].append(dict(d["tensors"][0])), "tensor 'a' appears twice"),
        (lambda d: d["tensors"][1]["pieces"].pop(1), "tensor 'big': pieces are not contiguous"),
        (lambda d: d.update(weight_version=[1]), "weight_version must be"),
        (lambda d: d["tensors"][0]["pieces"][0].__setitem__(1, 2), "tensor 'a': piece offset 2"),
    ],
)
def test_validation_errors_name_the_problem(mutate, message: str) -> None:
    d = json.loads(plan(specs(), weight_version=1, bucket_bytes=1024).to_json())
    mutate(d)
    with pytest.raises(ManifestError, match=message.replace("(", r"\(")):
        Manifest.from_dict(d)


def test_not_json_is_a_clear_error() -> None:
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.from_json(b"\x80\x04pickle?")


def test_overlapping_pieces_are_refused() -> None:
    d = json.loads(plan([TensorSpec("x", "float32", (4,)), TensorSpec("y", "float32", (4,))],
                        weight_version=1, bucket_bytes=1024).to_json())
    d["tensors"][1]["pieces"][0][1] = 0
    with pytest.raises(ManifestError, match="overlaps"):
        Manifest.from_dict(d)
