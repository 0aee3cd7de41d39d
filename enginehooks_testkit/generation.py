"""What the engine drivers and server launchers return: greedy generations with the
logprob of every chosen token, and their exact comparison (the oracle's test)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Prompts (token ids) and length of every greedy comparison.
PROMPTS: list[list[int]] = [[5, 6, 7, 8], [10, 11, 12], [40, 41, 42, 43, 44, 45]]
NEW_TOKENS = 8


@dataclass(frozen=True)
class Generation:
    """Greedy tokens of one prompt, the logprob of each, and the weight version the
    engine says produced them (None where the engine does not say)."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    version: str | None = None


def first_difference(a: Sequence[Generation], b: Sequence[Generation]) -> str | None:
    """Where two runs differ (tokens, then logprobs, exactly), or None if they are equal."""
    if len(a) != len(b):
        return f"{len(a)} generations vs {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x.tokens != y.tokens:
            return f"prompt {i}: tokens {list(x.tokens)} vs {list(y.tokens)}"
        for j, (p, q) in enumerate(zip(x.logprobs, y.logprobs)):
            if p != q:
                return f"prompt {i} token {j}: logprob {p!r} vs {q!r}"
    return None
