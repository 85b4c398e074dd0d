"""Per-session KV caches of a model service, under a byte budget.

A cache is a disposable copy of a prefix of the session's committed tokens
(DESIGN §2). A call names the prefix it assumes; if the cache holds more, it
is cropped (rollback is a length change); if it holds less or something else,
the call is a cache miss and the orchestrator re-syncs.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch

from tandem import fingerprint

log = logging.getLogger(__name__)


class CacheMiss(Exception):
    def __init__(self, session_id: str, expected: int, held: int, why: str | None = None):
        super().__init__(why or (
            f"cache miss for session {session_id}: expected a prefix of {expected} tokens, "
            f"held {held} that do not match"
        ))
        self.expected = expected
        self.held = held


@dataclass
class SessionCache:
    """A session's token history, and the keys/values of its first kv_len tokens.

    Drafters that need no model (n-gram) keep only the history; the n-gram +
    model drafter lets the history run ahead of the KV and catches up in one
    forward when the model is needed."""

    kv: object  # transformers DynamicCache, tandem.lean.StaticKV, or NullKV
    tokens: list[int] = field(default_factory=list)  # the history
    fps: list[int] = field(default_factory=list)  # fps[i]: fingerprint of tokens[:i+1]
    kv_len: int = 0  # tokens[:kv_len] are in kv
    last_used: float = field(default_factory=time.monotonic)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, tokens: list[int]) -> None:
        start = self.fps[-1] if self.fps else fingerprint.EMPTY
        self.fps.extend(fingerprint.prefix_table(tokens, start))
        self.tokens.extend(tokens)

    def unfed(self) -> list[int]:
        """History tokens whose keys/values are not in kv yet."""
        return self.tokens[self.kv_len:]

    def mark_fed(self) -> None:
        self.kv_len = len(self.tokens)

    def crop(self, length: int) -> int:
        """Keeps the first `length` tokens; returns how many were dropped."""
        dropped = len(self.tokens) - length
        if dropped > 0:
            del self.tokens[length:]
            del self.fps[length:]
        if self.kv_len > length:
            self.kv.crop(-(self.kv_len - length))
            self.kv_len = length
        return max(dropped, 0)

    def rewrite_tail(self, length: int, tokens: list[int]) -> None:
        """The history becomes its first `length` tokens, then `tokens`, all in
        kv: for a caller that has already put kv in that state (a verify that
        kept one path of a token tree)."""
        del self.tokens[length:]
        del self.fps[length:]
        self.append(tokens)
        self.kv_len = len(self.tokens)

    def drop_partial_step(self) -> bool:
        """After a forward that stopped between layers: every layer back to the
        kv_len tokens it held before. False when a layer cannot be trusted to
        say its length (not a plain DynamicLayer); the caller then drops the cache."""
        from transformers.cache_utils import DynamicLayer

        if hasattr(self.kv, "drop_partial_step"):  # tandem.lean.StaticKV
            self.kv.drop_partial_step(self.kv_len)
            return True
        layers = getattr(self.kv, "layers", ())
        if any(type(layer) is not DynamicLayer for layer in layers):
            return False
        for layer in layers:
            extra = layer.get_seq_length() - self.kv_len
            if extra > 0:
                layer.crop(-extra)
        return True

    def fork(self, length: int) -> "SessionCache":
        """A copy of the first `length` tokens, history and keys/values, that
        shares no tensor with this cache."""
        kv_len = min(self.kv_len, length)
        return SessionCache(_fork_kv(self.kv, kv_len), self.tokens[:length], self.fps[:length], kv_len)

    def matches(self, length: int, fp: int) -> bool:
        if length == 0:
            return True
        return length <= len(self.fps) and self.fps[length - 1] == fp

    def nbytes(self) -> int:
        if callable(getattr(self.kv, "nbytes", None)):  # tandem.lean.StaticKV
            return self.kv.nbytes() + 16 * len(self.tokens)
        # The storage, not the tensor: a cropped layer is a view that still
        # holds the rejected drafts' keys and values until its next update.
        storages = {}
        for layer in getattr(self.kv, "layers", ()):
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(tensor, torch.Tensor):
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values()) + 16 * len(self.tokens)


def _fork_kv(kv, length: int):
    """kv's first `length` positions, copied: by the cache's own fork
    (StaticKV, NullKV), else per layer for a DynamicCache of plain layers,
    else a deep copy cropped."""
    import copy

    from transformers.cache_utils import DynamicLayer

    if hasattr(kv, "fork"):
        return kv.fork(length)
    layers = getattr(kv, "layers", None)
    if layers is not None and all(type(layer) is DynamicLayer for layer in layers):
        forked = copy.copy(kv)
        forked.layers = []
        for layer in layers:
            copied = copy.copy(layer)
            if getattr(layer, "keys", None) is not None:
                copied.keys = layer.keys[..., :length, :].clone()
                copied.values = layer.values[..., :length, :].clone()
            forked.layers.append(copied)
        return forked
    forked = copy.deepcopy(kv)
    extra = forked.get_seq_length() - length
    if extra > 0:
        forked.crop(-extra)
    return forked


class NullKV:
    """The KV cache of a drafter without a model."""

    layers = ()

    def crop(self, tokens_to_remove: int) -> None:
        pass

    def fork(self, length: int) -> "NullKV":
        return NullKV()


@dataclass
class CacheCounters:
    evictions: int = 0
    misses: int = 0
    hits: int = 0
    forks: int = 0  # ForkSession calls that copied a prefix


class SessionCacheStore:
    """LRU store of SessionCache objects. Not thread-safe: one model worker uses it."""

    def __init__(self, new_kv: Callable[[], object], budget_bytes: int = 0, ttl_s: float = 0):
        self._new_kv = new_kv
        self.budget_bytes = budget_bytes
        self.ttl_s = ttl_s
        self._sessions: OrderedDict[str, SessionCache] = OrderedDict()
        self._bytes: dict[str, int] = {}  # per session, as of its last enforce_budget
        self._total = 0
        self._next_expiry = 0.0
        self.counters = CacheCounters()

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def checkout(self, session_id: str, prefix_len: int, prefix_fp: int) -> tuple[SessionCache, int]:
        """The session's cache cropped to the named prefix, and the tokens cropped.

        prefix_len 0 starts the session afresh. Raises CacheMiss otherwise when
        the cache does not hold the prefix."""
        self.expire_idle()
        cache = self._sessions.get(session_id)
        if prefix_len == 0:
            cache = SessionCache(self._new_kv())
            self._sessions[session_id] = cache
        elif cache is None or not cache.matches(prefix_len, prefix_fp):
            self.counters.misses += 1
            raise CacheMiss(session_id, prefix_len, 0 if cache is None else len(cache))
        else:
            self.counters.hits += 1
        self._sessions.move_to_end(session_id)
        cache.last_used = time.monotonic()
        return cache, cache.crop(prefix_len)

    def peek(self, session_id: str) -> SessionCache | None:
        """The session's cache as it is: no crop, no recency, no counting."""
        return self._sessions.get(session_id)

    def release(self, session_id: str) -> bool:
        self._total -= self._bytes.pop(session_id, 0)
        return self._sessions.pop(session_id, None) is not None

    def fork(self, source_id: str, session_id: str, prefix_len: int, prefix_fp: int) -> bool:
        """session_id becomes a copy of the first prefix_len tokens of
        source_id's cache, if that holds the named prefix; else session_id
        holds nothing. Returns whether it was copied."""
        self.expire_idle()
        self.release(session_id)
        source = self._sessions.get(source_id)
        if prefix_len < 1 or source is None or not source.matches(prefix_len, prefix_fp):
            return False
        self._sessions[session_id] = source.fork(prefix_len)
        self.counters.forks += 1
        self.enforce_budget(keep=session_id)
        return True

    def total_bytes(self) -> int:
        return self._total

    def enforce_budget(self, keep: str) -> list[str]:
        """Accounts for `keep`'s new size (it was just used), then evicts least
        recently used sessions, never `keep`, until under budget. O(evicted)."""
        cache = self._sessions.get(keep)
        if cache is not None:
            size = cache.nbytes()
            self._total += size - self._bytes.get(keep, 0)
            self._bytes[keep] = size
        evicted = []
        if not self.budget_bytes:
            return evicted
        for session_id in list(self._sessions):
            if self._total <= self.budget_bytes:
                break
            if session_id == keep:
                continue
            self.release(session_id)
            evicted.append(session_id)
        self.counters.evictions += len(evicted)
        for session_id in evicted:
            log.info("evicted session %s to stay under %d bytes", session_id, self.budget_bytes)
        return evicted

    def expire_idle(self) -> None:
        """Drops sessions idle past the TTL; scans at most once a second."""
        now = time.monotonic()
        if not self.ttl_s or now < self._next_expiry:
            return
        self._next_expiry = now + 1.0
        for session_id, cache in list(self._sessions.items()):  # least recently used first
            if cache.last_used >= now - self.ttl_s:
                break
            self.release(session_id)
            self.counters.evictions += 1
            log.info("expired idle session %s", session_id)
