"""Prompt lookup: draft by matching the last n tokens against the session's own
history (no model). Helps on code and on edits of text already in the prompt."""
from __future__ import annotations


def lookup(history: list[int], k: int, ngram_max: int = 4, ngram_min: int = 1) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the
    longest suffix n-gram of history (n from ngram_max down to ngram_min).
    When the continuation runs out, matching repeats on the extended history."""
    proposal: list[int] = []
    extended = list(history)
    while len(proposal) < k:
        continuation = _continuation(extended, k - len(proposal), ngram_max, ngram_min)
        if not continuation:
            break
        proposal += continuation
        extended += continuation
    return proposal


def _continuation(history: list[int], k: int, ngram_max: int, ngram_min: int) -> list[int]:
    size = len(history)
    for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        suffix = history[size - n:]
        for start in range(size - n - 1, -1, -1):  # most recent earlier occurrence first
            if history[start:start + n] == suffix:
                follow = history[start + n: start + n + k]
                if follow:
                    return follow
    return []
