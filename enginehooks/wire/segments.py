"""A segment header of a stream whose names are known only as it is read (verl's weight
generator, `verl_ext/checkpoint_engine.py`): the segment's manifest and, with a shared
secret, the token that signs it. The sender builds it (`segment_header`); each receiver
reads it and checks the token before anything is planned from it (`read_segment`).
"""

from __future__ import annotations

import json
from typing import Any

from enginehooks.core.auth import Verifier, sign
from enginehooks.core.errors import ManifestError

#: what a segment's token signs (the manifest's JSON text)
SEGMENT_VERB = "verl_segment"
#: the largest segment header a receiver reads (a manifest of ~1 M tensors)
MAX_HEADER_BYTES = 64 << 20


def segment_header(secret: bytes | None, manifest_json: str) -> bytes:
    """The header's bytes: the manifest's JSON text and its token (None without a secret)."""
    token = sign(secret, SEGMENT_VERB, manifest_json) if secret else None
    return json.dumps({"manifest": manifest_json, "token": token}).encode()


def read_segment(raw: bytes, verifier: Verifier | None) -> str:
    """The manifest's JSON text of a header, its token checked when there is a verifier
    (`AuthError` if it does not verify); `ManifestError` if it is not a header."""
    try:
        header: Any = json.loads(raw)
    except ValueError as e:
        raise ManifestError(f"a segment header that is not JSON: {e}") from None
    text = header.get("manifest") if isinstance(header, dict) else None
    if not isinstance(text, str):
        raise ManifestError("a segment header without a manifest")
    if verifier is not None:
        verifier.verify(SEGMENT_VERB, text, header.get("token"))
    return text
