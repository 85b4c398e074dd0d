"""Rolling fingerprints of token prefixes (DESIGN §2, invariant 2).

fp(t_0 … t_{n-1}) = Σ (t_i + 1) · B^(n-1-i)  mod P, so extending a prefix by
one token is one multiply-add, and the fingerprint of every prefix of a
sequence is available in one pass.
"""
from __future__ import annotations

from typing import Iterable

MODULUS = (1 << 61) - 1  # a Mersenne prime
BASE = 1_000_003
EMPTY = 0


def extend(fp: int, tokens: Iterable[int]) -> int:
    """Fingerprint of (prefix + tokens), given the prefix's fingerprint."""
    for token in tokens:
        fp = (fp * BASE + int(token) + 1) % MODULUS
    return fp


def of(tokens: Iterable[int]) -> int:
    return extend(EMPTY, tokens)


def prefix_table(tokens: Iterable[int], start: int = EMPTY) -> list[int]:
    """table[i] = fingerprint of the first i+1 tokens (continuing from `start`)."""
    table = []
    fp = start
    for token in tokens:
        fp = (fp * BASE + int(token) + 1) % MODULUS
        table.append(fp)
    return table
