"""Every check of `Manifest.from_dict` refuses exactly what it names, with its message
(found by `make mutants`: the fuzz tests only ask for *a* ManifestError, so a check
that answered with a neighbour's message, or a bound off by one, went unnoticed).

Each case edits one field of a valid manifest and expects the refusal, by type and by
its whole text; each bound is also checked on its other side (accepted)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest

from enginehooks.core import manifest as mf
from enginehooks.core.errors import ManifestError
from enginehooks.core.manifest import Manifest, TensorSpec, plan

GOOD = plan([TensorSpec("a", "float32", (4, 3)), TensorSpec("b", "bfloat16", (70,)),
             TensorSpec("c", "int64", (2,))], weight_version=1, bucket_bytes=128)


def good() -> dict[str, Any]:
    return copy.deepcopy(GOOD.to_dict())


def edited(edit: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    d = good()
    edit(d)
    return d


def refusal(d: Any) -> str:
    with pytest.raises(ManifestError) as err:
        Manifest.from_dict(d)
    return str(err.value)


def t(d: dict[str, Any], i: int = 0) -> dict[str, Any]:
    return d["tensors"][i]


def test_the_good_manifest_round_trips() -> None:
    assert GOOD.to_dict()["tensors"][0]["pieces"] == [[0, 0, 0, 48]]
    assert Manifest.from_dict(good()) == GOOD
    assert Manifest.from_json(GOOD.to_json()) == GOOD


CASES: list[tuple[str, Callable[[dict[str, Any]], Any], str]] = [
    ("tensor not an object", lambda d: d["tensors"].__setitem__(0, ["a"]),
     "each tensor must be a JSON object"),
    ("name missing", lambda d: t(d).pop("name"),
     "tensor name must be a non-empty string of at most 1024 characters, got 'None'"),
    ("name not a string", lambda d: t(d).__setitem__("name", 7),
     "tensor name must be a non-empty string of at most 1024 characters, got '7'"),
    ("name empty", lambda d: t(d).__setitem__("name", ""),
     "tensor name must be a non-empty string of at most 1024 characters, got ''"),
    ("name too long", lambda d: t(d).__setitem__("name", "x" * 1025),
     "tensor name must be a non-empty string of at most 1024 characters, got " + repr("x" * 80)),
    ("name twice", lambda d: t(d, 1).__setitem__("name", "a"), "tensor 'a' appears twice"),
    ("dtype missing", lambda d: t(d).pop("dtype"), "tensor 'a': unsupported dtype None"),
    ("dtype unknown", lambda d: t(d).__setitem__("dtype", "complex64"),
     "tensor 'a': unsupported dtype 'complex64'"),
    ("dtype not a string", lambda d: t(d).__setitem__("dtype", 4),
     "tensor 'a': unsupported dtype 4"),
    ("shape missing", lambda d: t(d).pop("shape"),
     "tensor 'a': shape must be a list of integers >= 0"),
    ("shape a tuple-like string", lambda d: t(d).__setitem__("shape", "4,3"),
     "tensor 'a': shape must be a list of integers >= 0"),
    ("shape negative", lambda d: t(d).__setitem__("shape", [4, -3]),
     "tensor 'a': shape must be a list of integers >= 0"),
    ("shape float", lambda d: t(d).__setitem__("shape", [4, 3.0]),
     "tensor 'a': shape must be a list of integers >= 0"),
    ("shape bool", lambda d: t(d).__setitem__("shape", [True, 3]),
     "tensor 'a': shape must be a list of integers >= 0"),
    ("pieces missing", lambda d: t(d).pop("pieces"), "tensor 'a': pieces must be a list"),
    ("piece not a list", lambda d: t(d).__setitem__("pieces", [{"b": 0}]),
     "tensor 'a': a piece must be [bucket, offset, start, nbytes]"),
    ("piece of 3", lambda d: t(d).__setitem__("pieces", [[0, 0, 0]]),
     "tensor 'a': a piece must be [bucket, offset, start, nbytes]"),
    ("piece of 5", lambda d: t(d).__setitem__("pieces", [[0, 0, 0, 48, 0]]),
     "tensor 'a': a piece must be [bucket, offset, start, nbytes]"),
    ("piece field negative", lambda d: t(d).__setitem__("pieces", [[0, -64, 0, 48]]),
     "tensor 'a' piece field must be an integer >= 0, got -64"),
    ("piece field bool", lambda d: t(d).__setitem__("pieces", [[0, 0, False, 48]]),
     "tensor 'a' piece field must be an integer >= 0, got False"),
    ("bucket past the end", lambda d: t(d).__setitem__("pieces", [[len(d["buckets"]), 0, 0, 48]]),
     f"tensor 'a': piece names bucket {len(GOOD.buckets)}, which does not exist"),
    ("pieces not contiguous", lambda d: t(d).__setitem__("pieces", [[0, 0, 0, 24], [0, 64, 32, 24]]),
     "tensor 'a': pieces are not contiguous at byte 32"),
    ("first piece not at 0", lambda d: t(d).__setitem__("pieces", [[0, 0, 4, 48]]),
     "tensor 'a': pieces are not contiguous at byte 4"),
    ("offset unaligned", lambda d: t(d).__setitem__("pieces", [[0, 2, 0, 48]]),
     "tensor 'a': piece offset 2 is not aligned"),
    ("piece past the bucket", lambda d: t(d).__setitem__("pieces", [[0, 96, 0, 48]]),
     "tensor 'a': piece runs past the end of bucket 0"),
    ("too few bytes", lambda d: t(d).__setitem__("pieces", [[0, 0, 0, 44]]),
     "tensor 'a': pieces carry 44 bytes but float32[4, 3] needs 48"),
    ("too many bytes", lambda d: (d["buckets"][0].__setitem__(1, 128),
                                  t(d).__setitem__("pieces", [[0, 0, 0, 52]])),
     "tensor 'a': pieces carry 52 bytes but float32[4, 3] needs 48"),
]


@pytest.mark.parametrize("edit,message", [(e, m) for _, e, m in CASES],
                         ids=[c[0] for c in CASES])
def test_each_tensor_check_refuses_with_its_message(edit: Callable[[dict[str, Any]], Any],
                                                     message: str) -> None:
    assert refusal(edited(edit)) == message


def one_tensor(pieces: list[list[int]], bucket_nbytes: int = 128) -> dict[str, Any]:
    """A float32[16] (64 bytes) in one bucket of `bucket_nbytes`."""
    return {"format_version": 1, "weight_version": 1, "bucket_bytes": 128, "checksum": None,
            "meta": {}, "buckets": [[0, bucket_nbytes, None]],
            "tensors": [{"name": "w", "dtype": "float32", "shape": [16], "pieces": pieces}]}


def test_bounds_are_accepted_on_their_inside() -> None:
    # A name of exactly the cap; a zero-sized dimension; a piece ending at its bucket's end.
    d = good()
    t(d)["name"] = "x" * mf.MAX_NAME_CHARS
    assert Manifest.from_dict(d).tensors[0].name == "x" * 1024
    d = good()
    t(d, 2).update(shape=[0, 2], pieces=[])
    assert Manifest.from_dict(d).tensors[2].shape == (0, 2)
    m = Manifest.from_dict(one_tensor([[0, 64, 0, 64]]))
    assert m.tensors[0].pieces == (mf.Piece(0, 64, 0, 64),)
    assert refusal(one_tensor([[0, 128, 0, 64]])) == "tensor 'w': piece runs past the end of bucket 0"
    assert refusal(one_tensor([[0, 64, 0, 64]], bucket_nbytes=127)) == (
        "tensor 'w': piece runs past the end of bucket 0")


def test_a_tensor_in_pieces_across_buckets() -> None:
    d = one_tensor([[0, 64, 0, 32], [1, 0, 32, 32]])
    d["buckets"].append([1, 32, None])
    m = Manifest.from_dict(d)
    assert m.tensors[0].pieces == (mf.Piece(0, 64, 0, 32), mf.Piece(1, 0, 32, 32))
    # The second piece must start where the first ended, in bytes of the tensor.
    d["tensors"][0]["pieces"][1][2] = 0
    assert refusal(d) == "tensor 'w': pieces are not contiguous at byte 0"
    # Alignment is by the dtype's element size: 4 for float32 (8 is fine, 2 is not).
    assert Manifest.from_dict(one_tensor([[0, 8, 0, 64]])).tensors[0].pieces[0].offset == 8
    assert refusal(one_tensor([[0, 6, 0, 64]])) == "tensor 'w': piece offset 6 is not aligned"


def test_seen_names_are_kept_across_tensors() -> None:
    # The duplicate is the *third* tensor naming the first: `seen` must hold every name.
    d = edited(lambda d: t(d, 2).__setitem__("name", "a"))
    assert refusal(d) == "tensor 'a' appears twice"
    d = edited(lambda d: t(d, 2).__setitem__("name", "b"))
    assert refusal(d) == "tensor 'b' appears twice"


def test_every_dtype_size_is_torchs() -> None:
    import torch

    for name, size in mf.DTYPE_SIZES.items():
        assert torch.empty((), dtype=getattr(torch, name)).element_size() == size, name


def test_json_text_is_parsed_with_the_same_checks() -> None:
    d = edited(lambda d: t(d).__setitem__("dtype", "complex64"))
    with pytest.raises(ManifestError) as err:
        Manifest.from_json(json.dumps(d))
    assert str(err.value) == "tensor 'a': unsupported dtype 'complex64'"


def test_the_text_cap_is_checked_first_and_is_inclusive(monkeypatch: pytest.MonkeyPatch) -> None:
    text = GOOD.to_json()
    monkeypatch.setattr(mf, "MAX_MANIFEST_CHARS", len(text))
    assert Manifest.from_json(text) == GOOD  # exactly the cap: read
    with pytest.raises(ManifestError) as err:
        Manifest.from_json(text + " ")
    assert str(err.value) == (f"manifest of {len(text) + 1} characters exceeds the cap of "
                              f"{len(text)}")
    with pytest.raises(ManifestError) as err:  # bytes are counted too
        Manifest.from_json(text.encode() + b" ")
    assert str(err.value).startswith(f"manifest of {len(text) + 1} characters")


@pytest.mark.parametrize("data", [[], "manifest", 1, None])
def test_a_manifest_that_is_not_an_object_is_refused(data: Any) -> None:
    assert refusal(data) == "manifest must be a JSON object"


MAXB = mf.MAX_BUCKET_BYTES
TOP: list[tuple[str, Callable[[dict[str, Any]], Any], str]] = [
    ("format_version missing", lambda d: d.pop("format_version"),
     "manifest format_version None is not supported (this enginehooks reads 1, 2)"),
    ("format_version 3", lambda d: d.__setitem__("format_version", 3),
     "manifest format_version 3 is not supported (this enginehooks reads 1, 2)"),
    ("format_version True", lambda d: d.__setitem__("format_version", True),
     "manifest format_version True is not supported (this enginehooks reads 1, 2)"),
    ("weight_version missing", lambda d: d.pop("weight_version"),
     "weight_version must be an int or a str, got None"),
    ("weight_version bool", lambda d: d.__setitem__("weight_version", False),
     "weight_version must be an int or a str, got False"),
    ("weight_version float", lambda d: d.__setitem__("weight_version", 1.5),
     "weight_version must be an int or a str, got 1.5"),
    ("bucket_bytes 0", lambda d: d.__setitem__("bucket_bytes", 0),
     "bucket_bytes must be an integer >= 1, got 0"),
    ("bucket_bytes text", lambda d: d.__setitem__("bucket_bytes", "128"),
     "bucket_bytes must be an integer >= 1, got '128'"),
    ("bucket_bytes bool", lambda d: d.__setitem__("bucket_bytes", True),
     "bucket_bytes must be an integer >= 1, got True"),
    ("bucket_bytes over the cap", lambda d: d.__setitem__("bucket_bytes", MAXB + 1),
     f"bucket_bytes {MAXB + 1} exceeds the cap of {MAXB} bytes"),
    ("checksum a number", lambda d: d.__setitem__("checksum", 5),
     "checksum must be a name or null, got 5"),
    ("checksum unknown", lambda d: d.__setitem__("checksum", "md5"),
     "unknown checksum 'md5'; known: ['crc32', 'sum64', 'xxh3'] or null"),
    ("meta a list", lambda d: d.__setitem__("meta", []), "meta must be a JSON object"),
    ("buckets missing", lambda d: d.pop("buckets"), "buckets must be a list"),
    ("bucket of 2", lambda d: d["buckets"].__setitem__(0, [0, 48]),
     'bucket 0: expected [index, nbytes, checksum] or [index, nbytes, checksum, "direct"]'),
    ("bucket of 4, not direct", lambda d: d["buckets"].__setitem__(0, [0, 48, None, "packed"]),
     'bucket 0: expected [index, nbytes, checksum] or [index, nbytes, checksum, "direct"]'),
    ("bucket an object", lambda d: d["buckets"].__setitem__(1, {"index": 1}),
     'bucket 1: expected [index, nbytes, checksum] or [index, nbytes, checksum, "direct"]'),
    ("direct in version 1", lambda d: d["buckets"].__setitem__(0, [0, 48, None, "direct"]),
     "bucket 0: direct buckets need format_version 2, the manifest says 1"),
    ("index out of order", lambda d: d["buckets"][1].__setitem__(0, 2),
     "bucket 1: index 2 out of order"),
    ("nbytes negative", lambda d: d["buckets"][1].__setitem__(1, -1),
     "bucket 1 nbytes must be an integer >= 0, got -1"),
    ("nbytes over bucket_bytes", lambda d: d["buckets"][1].__setitem__(1, 129),
     "bucket 1: 129 bytes exceed bucket_bytes 128"),
    ("nbytes over the cap, unsplit",
     lambda d: (d["meta"].__setitem__("unsplit", True), d["buckets"][1].__setitem__(1, MAXB + 1)),
     f"bucket 1: {MAXB + 1} bytes exceed the cap of {MAXB} bytes"),
    ("unsplit must be true", lambda d: (d["meta"].__setitem__("unsplit", 1),
                                        d["buckets"][1].__setitem__(1, 129)),
     "bucket 1: 129 bytes exceed bucket_bytes 128"),
    ("bucket checksum a number", lambda d: d["buckets"][2].__setitem__(2, 5),
     "bucket 2: checksum must be a string (at most 256 characters) or null"),
    ("bucket checksum too long", lambda d: d["buckets"][2].__setitem__(2, "f" * 257),
     "bucket 2: checksum must be a string (at most 256 characters) or null"),
    ("tensors missing", lambda d: d.pop("tensors"), "tensors must be a list"),
    ("pieces overlap", lambda d: t(d, 2)["pieces"][0].__setitem__(1, 8),
     "tensor 'c' overlaps another in bucket 2"),
]


@pytest.mark.parametrize("edit,message", [(e, m) for _, e, m in TOP], ids=[c[0] for c in TOP])
def test_each_manifest_check_refuses_with_its_message(edit: Callable[[dict[str, Any]], Any],
                                                      message: str) -> None:
    assert refusal(edited(edit)) == message


def empty(**fields: Any) -> dict[str, Any]:
    return {"format_version": 1, "weight_version": 1, "bucket_bytes": 1, "checksum": None,
            "meta": {}, "buckets": [], "tensors": [], **fields}


def test_what_is_read_is_kept_and_bounds_are_inclusive() -> None:
    m = Manifest.from_dict(empty(weight_version="v1", meta={"step": 3}, checksum="xxh3"))
    assert (m.weight_version, m.bucket_bytes, m.checksum, m.format_version, m.meta,
            m.tensors, m.buckets) == ("v1", 1, "xxh3", 1, {"step": 3}, (), ())
    assert Manifest.from_dict(empty(format_version=2)).format_version == 2
    assert Manifest.from_dict(empty(bucket_bytes=MAXB)).bucket_bytes == MAXB
    d = empty()
    d.pop("meta")
    assert Manifest.from_dict(d).meta == {}
    # A bucket of exactly bucket_bytes; one larger when the manifest says unsplit; a
    # checksum of 256 characters.
    m = Manifest.from_dict(empty(bucket_bytes=64, buckets=[[0, 64, "f" * 256]]))
    assert m.buckets == (mf.BucketEntry(0, 64, "f" * 256, False),)
    m = Manifest.from_dict(empty(bucket_bytes=64, meta={"unsplit": True},
                                 buckets=[[0, MAXB, None]]))
    assert m.buckets[0].nbytes == MAXB


def test_counts_are_capped_inclusively(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mf, "MAX_BUCKETS", 3)
    monkeypatch.setattr(mf, "MAX_TENSORS", 3)
    assert Manifest.from_dict(good()) == GOOD  # 3 buckets, 3 tensors
    d = edited(lambda d: d["buckets"].append([3, 0, None]))
    assert refusal(d) == "4 buckets exceed the cap of 3"
    d = edited(lambda d: d["tensors"].append({"name": "z", "dtype": "int8", "shape": [0],
                                              "pieces": []}))
    assert refusal(d) == "4 tensors exceed the cap of 3"


def direct(bucket_nbytes: int, *tensors: tuple[str, list[list[int]]]) -> dict[str, Any]:
    """Format 2, one direct bucket of `bucket_nbytes`, float32[16] tensors (64 bytes)."""
    return {"format_version": 2, "weight_version": 1, "bucket_bytes": 128, "checksum": None,
            "meta": {}, "buckets": [[0, bucket_nbytes, None, "direct"]],
            "tensors": [{"name": n, "dtype": "float32", "shape": [16], "pieces": p}
                        for n, p in tensors]}


NOT_ONE = "bucket 0 is direct but does not hold exactly one piece filling it from offset 0"


def test_direct_buckets_hold_exactly_one_piece_from_offset_0() -> None:
    m = Manifest.from_dict(direct(64, ("w", [[0, 0, 0, 64]])))
    assert m.buckets == (mf.BucketEntry(0, 64, None, True),) and m.format_version == 2
    assert refusal(direct(128, ("w", [[0, 64, 0, 64]]))) == NOT_ONE  # not from offset 0
    assert refusal(direct(128, ("w", [[0, 0, 0, 64]]))) == NOT_ONE  # not filling it
    assert refusal(direct(128, ("w", [[0, 0, 0, 64]]), ("v", [[0, 64, 0, 64]]))) == NOT_ONE
    assert refusal(direct(64)) == NOT_ONE  # empty
