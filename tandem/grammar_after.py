"""Where a grammar that waits for a text begins (SamplingParams.grammar_after:
a reasoning model's "</think>"): after the token in which that text first
ends, counting from the request's grammar_start. By the tokens' text, not
their ids, so a model that writes the tag in other tokens than the tag alone
takes (" </", "think", ">") still ends its reasoning there.

A session's calls ask again and again over a completion that grows by a few
tokens a round, and is cut back a few where drafts are rejected. Each search
is kept (its tokens, their bytes, where they end) and a call extends the one
that shares the most of its tokens: it decodes only the tokens it has not
seen, and once the text is found a call only compares its tokens up to there."""
from __future__ import annotations

import bisect
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

MAX_KEYS = 32  # (text, grammar_start) pairs kept, least recently used dropped
MAX_SEARCHES = 4  # searches kept per pair (sessions with prompts as long decoding at once)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two lists share, by slice comparisons (in C):
    the common case, one a prefix of the other, in one of them. Both lists,
    or both arrays."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n - 1  # a[:low] == b[:low], a[:high + 1] != b[:high + 1]
    while low < high:
        mid = (low + high + 1) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid - 1
    return low


@dataclass
class _Search:
    # Arrays of 4-byte ints: a search of a 32k-token reasoning holds about 0.4 MB.
    tokens: array = field(default_factory=lambda: array("i"))  # from grammar_start on
    ends: array = field(default_factory=lambda: array("i"))  # ends[i]: bytes of tokens[:i + 1]
    data: bytearray = field(default_factory=bytearray)  # the tokens' bytes
    found: int | None = None  # tokens[:found] hold the text (and tokens stops there)

    def cut(self, length: int) -> None:
        del self.tokens[length:], self.ends[length:]
        del self.data[self.ends[-1] if self.ends else 0:]
        if self.found is not None and self.found > length:
            self.found = None


class AfterText:
    """The searches of one service. `decode(ids) -> bytes` is its tokenizer's
    (llguidance's decode_bytes: each token's bytes, concatenated)."""

    def __init__(self, decode: Callable[[list[int]], bytes]):
        self._decode = decode
        self._searches: OrderedDict[tuple, list[_Search]] = OrderedDict()

    def begins(self, after: Sequence[int], start: int, tokens: Sequence[int], before: int) -> int | None:
        """The absolute position from which the grammar applies: after the
        token in which `after`'s text first ends among tokens[start: before];
        None where it does not come there; `start` itself without `after`.
        Where that token holds more text (">\\n\\n"), the grammar begins after
        all of it. Not thread-safe: the caller holds a lock."""
        if not after:
            return start
        wanted = self._decode(list(after))
        if not wanted:  # a text of no bytes: nothing to wait for
            return start
        span = array("i", tokens[start:before])
        search = self._search((tuple(after), start), span)
        if search.found is not None:
            return start + search.found if len(span) >= search.found else None
        seen = len(search.tokens)
        for token in span[seen:]:
            search.tokens.append(token)
            search.data += self._decode([token])
            search.ends.append(len(search.data))
        at = search.data.find(wanted, max(0, (search.ends[seen - 1] if seen else 0) - len(wanted) + 1))
        if at < 0:
            return None
        search.found = bisect.bisect_left(search.ends, at + len(wanted)) + 1
        search.cut(search.found)
        return start + search.found

    def _search(self, key: tuple, span: array) -> _Search:
        """The kept search that shares the most tokens with `span`, cut back
        to them (a new one where none shares any)."""
        searches = self._searches.setdefault(key, [])
        self._searches.move_to_end(key)
        while len(self._searches) > MAX_KEYS:
            self._searches.popitem(last=False)
        best, best_common = None, 0
        for search in searches:
            common = common_prefix(search.tokens, span)
            if search.found is not None and common >= min(search.found, len(span)):
                best, best_common = search, len(search.tokens)  # it holds the answer for this span
                break
            if common > best_common or best is None:
                best, best_common = search, common
        if best is None or (best_common == 0 and best.tokens):
            best = _Search()
            searches.append(best)
            if len(searches) > MAX_SEARCHES:
                searches.pop(0)
        else:
            searches.remove(best)
            searches.append(best)  # most recently used last
        if best.found is None or best_common < min(best.found, len(span)):
            best.cut(best_common)
        return best
