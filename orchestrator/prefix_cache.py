"""Prefix reuse across stateless requests: a finished Generate parks its session
instead of deleting it, and a later Generate of the same tenant whose prompt
starts with the same tokens takes that session over.

This is what gives the stateless APIs (Generate without keep_session, and the
HTTP API's /v1/chat/completions, which resends the whole conversation each
turn) what a gRPC session gives a chat: both services keep the KV cache of the
earlier tokens, so a turn prefills only what is new. Taking a session over is
only a change of the committed tokens in Redis: they are cut back to the
common prefix, and by DESIGN §2.2 each service crops its cache to the prefix
its next call names. A service that evicted the session meanwhile answers that
call with a cache miss and is re-synced, so reuse can cost time, never change
an output.

Keys (all under a deployment's namespace: a hash of its two services'
addresses, so that two deployments on one Redis never take each other's):
  tandem:parked:{ns}                    sorted set: "{session_id} {tenant}" by park time, ms
  tandem:{tenant}:prefix:{ns}:{digest}  the id of a parked session whose tokens start
                                        with the block chain `digest` names
A parked session keeps its hash and token list, without its owner key, so no
client call can read, continue or delete it. A request that takes it over gets
it under a new id; the caches keep the name the services know them by
(SessionRecord.cache_id).

A stateless request whose prompt is in both services' caches (its first round
is done) shares it while it runs: a request of the same tenant that finds no
parked session with its prefix starts from a copy of the running one's caches
of the prefix they share (never the running session itself). So the n choices
of one prompt, or a batch of prompts with a common beginning, prefill it once
when the first goes ahead (the HTTP API's gateway does that):
  tandem:{tenant}:live:{ns}:{digest}    the id of a running session whose prompt
                                        starts with the block chain `digest` names
"""
from __future__ import annotations

import hashlib
import time
import uuid
from array import array

from orchestrator.config import PrefixCacheConfig
from orchestrator.replica_load import copy_id
from orchestrator.store import SessionRecord, SessionStore, stored_cache_id
from tandem import fingerprint

BLOCK = 16  # tokens a digest covers more than the one before it
MAX_CANDIDATES = 3  # parked sessions a lookup tries before it prefills afresh
MIN_FORK = 2 * BLOCK  # the shortest common prefix worth copying out of a parked session

# Deletes the keys that still name the session (another may have shared the
# same prefix since). KEYS: the live index keys. ARGV: the session id.
_UNSHARE = """
local n = 0
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then n = n + redis.call('DEL', key) end
end
return n
"""
# KEYS: the session's hash, its token list, its owner key, the parked set.
# ARGV: the member, the time in ms, the park TTL.
_PARK = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('DEL', KEYS[3])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[1])
return 1
"""
# Takes a parked session over if it is still the one that was read (same park
# time): moves it to a new session id (its caches keep their name, cache_id),
# cuts its tokens to the common prefix and the services' lengths with them, and
# gives it an owner. KEYS: the parked set, the parked hash and token list, the
# new hash, token list and owner key. ARGV: the member, its park time, the
# tenant, the prefix length, the session TTL, the parked session's id.
_CLAIM = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) ~= tonumber(ARGV[2]) then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
redis.call('RENAME', KEYS[2], KEYS[4])
redis.call('RENAME', KEYS[3], KEYS[5])
if not redis.call('HGET', KEYS[4], 'cache_id') then redis.call('HSET', KEYS[4], 'cache_id', ARGV[6]) end
local keep = tonumber(ARGV[4])
redis.call('LTRIM', KEYS[5], 0, keep - 1)
for _, field in ipairs({'draft_len', 'target_len'}) do
  local held = tonumber(redis.call('HGET', KEYS[4], field) or '0')
  if held > keep then redis.call('HSET', KEYS[4], field, keep) end
end
redis.call('HSET', KEYS[4], 'ttl', ARGV[5], 'messages', '[]')
for i = 4, 5 do redis.call('EXPIRE', KEYS[i], ARGV[5]) end
redis.call('SET', KEYS[6], ARGV[3], 'EX', ARGV[5])
return 1
"""


def block_digests(tokens: list[int]) -> list[str]:
    """digests[i] names tokens[:(i + 1) * BLOCK]: each block's digest covers
    the one before it, so equal digests mean equal prefixes."""
    digests, previous = [], b""
    for end in range(BLOCK, len(tokens) + 1, BLOCK):
        previous = hashlib.blake2b(previous + array("i", tokens[end - BLOCK:end]).tobytes(), digest_size=16).digest()
        digests.append(previous.hex())
    return digests


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def worth_taking(common: int, parked: int) -> bool:
    """Taking a session over saves prefilling `common` tokens and drops the
    cache of its other `parked - common`, which a later turn of its own
    conversation would have used; so only when it keeps at least half."""
    return 2 * common >= parked


class PrefixCache:
    """Parks finished stateless sessions and hands them, or a copy of their
    beginning, to requests that share their prefix. `release(cache_id)` frees a
    session's caches on both services; `fork(source_cache_id, cache_id, length,
    fingerprint)` copies a prefix of one session's caches into another on both,
    and says whether both did. `crowded(cache_id)`: whether the service
    replicas that hold a session's caches (orchestrator.replicas) are busy
    enough that a request is better placed afresh than given a copy there."""

    def __init__(self, store: SessionStore, config: PrefixCacheConfig, namespace: str, release, fork,
                 crowded=lambda cache_id: False):
        self.store = store
        self.fork = fork
        self.crowded = crowded  # whether a session's caches are on replicas too busy to copy them there
        self.config = config
        self.redis = store.redis
        self.namespace = hashlib.blake2b(namespace.encode(), digest_size=6).hexdigest()
        self.parked_key = f"tandem:parked:{self.namespace}"
        self.release = release
        self._park = self.redis.register_script(_PARK)
        self._claim = self.redis.register_script(_CLAIM)
        self._unshare = self.redis.register_script(_UNSHARE)

    def _index_key(self, tenant: str, digest: str) -> str:
        return f"tandem:{tenant}:prefix:{self.namespace}:{digest}"

    def _live_key(self, tenant: str, digest: str) -> str:
        return f"tandem:{tenant}:live:{self.namespace}:{digest}"

    @staticmethod
    def shareable(prompt: list[int]) -> list[str]:
        """The digests under which a running session shares `prompt`: none
        when it is too short for a copy (MIN_FORK)."""
        return block_digests(prompt) if len(prompt) > MIN_FORK else []

    async def share(self, record: SessionRecord, prompt: list[int], ttl_s: int = 0) -> None:
        """Offers the prompt of running session `record`, which both services
        hold now, to the tenant's requests that start alike (`take` copies it)."""
        if digests := self.shareable(prompt):
            async with self.redis.pipeline(transaction=False) as pipe:
                for digest in digests:
                    pipe.set(self._live_key(record.tenant, digest), record.session_id,
                             ex=ttl_s or self.store.default_ttl_s)
                await pipe.execute()

    async def unshare(self, record: SessionRecord, prompt: list[int]) -> None:
        """Withdraws what `share` offered, as the session ends."""
        if digests := self.shareable(prompt):
            await self._unshare(keys=[self._live_key(record.tenant, d) for d in digests], args=[record.session_id])

    async def take(self, tenant: str, prompt: list[int], ttl_s: int = 0) -> tuple[SessionRecord, int] | None:
        """A session for `prompt` that holds its longest prefix found among
        the parked sessions of `tenant` (short of the prompt's last token, which
        the turn must feed to be decoded after), and that prefix's length; None
        when there is none worth having. The parked session itself when the
        prefix keeps at least half its tokens (worth_taking): then it is the
        caller's under a new id (the id its last request reported stays gone),
        its committed tokens cut to the prefix. Else, from MIN_FORK tokens on,
        a new session with a copy of the parked one's caches of the prefix."""
        digests = block_digests(prompt[:-1])
        if not digests:
            return None
        found = await self.redis.mget([self._index_key(tenant, d) for d in digests])
        tried: set[str] = set()
        for blocks in range(len(found), 0, -1):
            value = found[blocks - 1]
            if value is None:
                continue
            session_id = value.decode()
            if session_id in tried:
                continue
            tried.add(session_id)
            taken = await self._take_or_copy(tenant, session_id, prompt[:-1], ttl_s or self.store.default_ttl_s)
            if taken is not None:
                return taken
            if len(tried) >= MAX_CANDIDATES:
                break
        return await self._copy_live(tenant, prompt[:-1], digests, ttl_s or self.store.default_ttl_s)

    async def _copy_live(self, tenant: str, prefix: list[int], digests: list[str], ttl_s: int):
        """A new session holding the longest prefix of `prefix` that a running
        session shares (`share`), copied from its caches; None when none does."""
        found = await self.redis.mget([self._live_key(tenant, d) for d in digests])
        tried: set[bytes] = set()
        for value in reversed(found):
            if value is None or value in tried:
                continue
            tried.add(value)
            session_id = value.decode()
            key = SessionStore._key(tenant, session_id)
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.lrange(f"{key}:tokens", 0, len(prefix) - 1)
                pipe.hget(key, "cache_id")
                tokens, cache_id = await pipe.execute()
            common = common_prefix([int(t) for t in tokens], prefix)
            if common >= MIN_FORK:  # else it ended (and is gone) meanwhile
                copied = await self._copy(tenant, stored_cache_id(cache_id, session_id), prefix[:common], ttl_s)
                if copied is not None:
                    return copied
            if len(tried) >= MAX_CANDIDATES:
                break
        return None

    async def _take_or_copy(self, tenant: str, session_id: str, prefix: list[int], ttl_s: int):
        member = f"{session_id} {tenant}"
        key = SessionStore._key(tenant, session_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.zscore(self.parked_key, member)
            pipe.lrange(f"{key}:tokens", 0, -1)
            pipe.hget(key, "cache_id")
            parked_at, tokens, cache_id = await pipe.execute()
        if parked_at is None:
            return None  # taken, evicted or expired meanwhile
        tokens = [int(t) for t in tokens]
        common = common_prefix(tokens, prefix)
        if not worth_taking(common, len(tokens)):
            if common < MIN_FORK:
                return None
            return await self._copy(tenant, stored_cache_id(cache_id, session_id), tokens[:common], ttl_s)
        new_id = uuid.uuid4().hex
        if not await self._claim(keys=[self.parked_key, *SessionStore.keys(tenant, session_id)[:2],
                                       *SessionStore.keys(tenant, new_id)],
                                 args=[member, int(parked_at), tenant, common, ttl_s, session_id]):
            return None
        return await self.store.load(tenant, new_id), common

    async def _copy(self, tenant: str, source_cache_id: str, prefix: list[int], ttl_s: int):
        """A new session of `tenant` holding `prefix`, its caches copied on both
        services from a parked session's, which stays parked; None when a
        service no longer holds them, or when its replicas are crowded. The
        copy's cache id places it on the replicas of its source's caches."""
        if self.crowded(source_cache_id):
            return None
        record = await self.store.create(tenant, ttl_s=ttl_s, cache_id=copy_id(source_cache_id))
        await self.store.append_tokens(record, prefix, count=False)  # reused: not the tenant's usage
        if not await self.fork(source_cache_id, record.cache_id, len(prefix), fingerprint.of(prefix)):
            await self.store.delete(tenant, record.session_id)
            return None
        record.draft_len = record.target_len = len(prefix)
        await self.store.save_meta(record)
        return record, len(prefix)

    async def park(self, record: SessionRecord) -> bool:
        """Parks a finished session (its lock released): keeps it on both
        services and indexes its tokens for `take`; then evicts what is over
        the limits. False when the session is gone (it is not parked then)."""
        now_ms = int(time.time() * 1e3)
        member = f"{record.session_id} {record.tenant}"
        ttl = self.config.ttl_s
        if not await self._park(keys=[*SessionStore.keys(record.tenant, record.session_id), self.parked_key],
                                args=[member, now_ms, ttl]):
            return False
        async with self.redis.pipeline(transaction=False) as pipe:
            for digest in block_digests(record.tokens):
                pipe.set(self._index_key(record.tenant, digest), record.session_id, ex=ttl)
            await pipe.execute()
        await self._evict(now_ms)
        return True

    async def _evict(self, now_ms: int) -> None:
        """Drops parked sessions past the TTL, then the oldest past the count."""
        expired = await self.redis.zrangebyscore(self.parked_key, "-inf", now_ms - self.config.ttl_s * 1000)
        over = max(0, await self.redis.zcard(self.parked_key) - len(expired) - self.config.sessions)
        oldest = await self.redis.zrange(self.parked_key, len(expired), len(expired) + over - 1) if over else []
        for member in [*expired, *oldest]:
            if await self.redis.zrem(self.parked_key, member):  # not taken meanwhile
                session_id, tenant = member.decode().split(" ", 1)
                await self.drop(tenant, session_id)

    async def drop(self, tenant: str, session_id: str) -> None:
        """Deletes a session that is no longer parked, in Redis and on both services."""
        keys = SessionStore.keys(tenant, session_id)[:2]
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hget(keys[0], "cache_id")
            pipe.delete(*keys)
            cache_id, _ = await pipe.execute()
        await self.release(stored_cache_id(cache_id, session_id))
