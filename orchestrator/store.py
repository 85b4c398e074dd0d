"""Sessions and their committed tokens in Redis: the source of truth (DESIGN §2.1).

Keys (all under a tenant):
  tandem:{tenant}:session:{id}         hash: created, ttl, messages (JSON), draft_len, target_len,
                                       and cache_id where it is not the id (orchestrator.prefix_cache:
                                       a session taken over, or a copy; orchestrator.replicas: a
                                       session placed on the least busy replicas)
  tandem:{tenant}:session:{id}:tokens  list: committed token ids, in order
  tandem:owner:{id}                    the owning tenant (for PERMISSION_DENIED)
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

import redis.asyncio as redis
from redis import exceptions as redis_errors

from orchestrator.quotas import usage_key

# Writes to a session that is still there: a session deleted (or expired)
# during a generation is not re-created by its last writes. KEYS: the hash,
# its token list, the owner key.
_APPEND = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
for i = 2, #ARGV, 4096 do
  redis.call('RPUSH', KEYS[2], unpack(ARGV, i, math.min(i + 4095, #ARGV)))
end
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[1]) end
if KEYS[4] then
  redis.call('INCRBY', KEYS[4], #ARGV - 1)
  redis.call('EXPIRE', KEYS[4], 120)
end
return 1
"""  # ARGV: ttl, then the tokens (pushed 4096 at a time: Lua's unpack has a limit). KEYS[4], if
# given: the tenant's token counter of this minute (orchestrator.quotas), raised by the tokens.
_SAVE_META = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""  # ARGV: field, value, ...

# Redis down or not answering: the session store is unavailable (the
# orchestrator answers UNAVAILABLE), as opposed to a request it refuses.
STORE_UNAVAILABLE = (redis_errors.ConnectionError, redis_errors.TimeoutError)


class SessionNotFound(KeyError):
    pass


class SessionForbidden(PermissionError):
    pass


class SessionBusy(RuntimeError):
    pass


@dataclass
class SessionRecord:
    session_id: str
    tenant: str
    tokens: list[int]
    messages: list[dict] = field(default_factory=list)  # chat history, for the template
    draft_len: int = 0  # how many committed tokens the draft service is believed to hold
    target_len: int = 0
    ttl_s: int = 3600
    # The name the model services keep its caches under: the session id,
    # unless the session took over a parked one's caches (prefix_cache).
    cache_id: str = ""
    lock: "_SessionLock | None" = field(default=None, repr=False, compare=False)  # while a request holds it

    def __post_init__(self):
        self.cache_id = self.cache_id or self.session_id


def stored_cache_id(raw: bytes | None, session_id: str) -> str:
    """A session's cache id from its hash's cache_id field (HGET), which only a
    session that took over another's caches has."""
    return (raw or b"").decode() or session_id


class SessionStore:
    def __init__(self, url: str, default_ttl_s: int = 3600, lock_s: int = 600, count_usage: bool = False):
        self.redis = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=10)
        self.default_ttl_s = default_ttl_s
        self.lock_s = lock_s
        self.count_usage = count_usage  # count committed tokens per tenant and minute (quotas)
        self._append = self.redis.register_script(_APPEND)
        self._save_meta = self.redis.register_script(_SAVE_META)

    @staticmethod
    def _key(tenant: str, session_id: str) -> str:
        return f"tandem:{tenant}:session:{session_id}"

    async def ping(self) -> None:
        await self.redis.ping()

    async def create(self, tenant: str, messages: list[dict] | None = None, ttl_s: int = 0,
                     cache_id: str = "") -> SessionRecord:
        """A new session; `cache_id`: the name its caches take on the services,
        where it is not the session's id (orchestrator.replicas: copy_id's for a
        copy, placed_id's for a session placed by load)."""
        session_id = uuid.uuid4().hex
        ttl = ttl_s or self.default_ttl_s
        key = self._key(tenant, session_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={
                "created": time.time(), "ttl": ttl, "messages": json.dumps(messages or []),
                "draft_len": 0, "target_len": 0, **({"cache_id": cache_id} if cache_id else {}),
            })
            pipe.expire(key, ttl)
            pipe.set(f"tandem:owner:{session_id}", tenant, ex=ttl)
            await pipe.execute()
        return SessionRecord(session_id=session_id, tenant=tenant, tokens=[], messages=list(messages or []), ttl_s=ttl,
                             cache_id=cache_id)

    async def _check_owner(self, tenant: str, session_id: str) -> None:
        owner = await self.redis.get(f"tandem:owner:{session_id}")
        if owner is None:
            raise SessionNotFound(f"session {session_id!r} does not exist or has expired")
        if owner.decode() != tenant:
            raise SessionForbidden(f"session {session_id!r} belongs to another tenant")

    async def load(self, tenant: str, session_id: str) -> SessionRecord:
        await self._check_owner(tenant, session_id)
        key = self._key(tenant, session_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(key)
            pipe.lrange(f"{key}:tokens", 0, -1)
            meta, tokens = await pipe.execute()
        if not meta:
            raise SessionNotFound(f"session {session_id!r} does not exist or has expired")
        return SessionRecord(
            session_id=session_id,
            tenant=tenant,
            tokens=[int(t) for t in tokens],
            messages=json.loads(meta[b"messages"]),
            draft_len=int(meta[b"draft_len"]),
            target_len=int(meta[b"target_len"]),
            ttl_s=int(meta[b"ttl"]),
            cache_id=stored_cache_id(meta.get(b"cache_id"), session_id),
        )

    @classmethod
    def keys(cls, tenant: str, session_id: str) -> list[str]:
        """A session's hash, its token list, and its owner key."""
        key = cls._key(tenant, session_id)
        return [key, f"{key}:tokens", f"tandem:owner:{session_id}"]

    def _keys(self, record: SessionRecord) -> list[str]:
        return self.keys(record.tenant, record.session_id)

    async def append_tokens(self, record: SessionRecord, tokens: list[int], count: bool = True) -> None:
        """Commits tokens (one round trip) and refreshes the TTL; keeps the
        request's lock alive; with count_usage, counts them against the
        tenant's minute unless `count` is false. Raises SessionNotFound if the session was deleted
        meanwhile (nothing is written then), SessionBusy if the lock was lost."""
        if record.lock is not None:
            await record.lock.keep()
        keys = self._keys(record) + ([usage_key(record.tenant)] if self.count_usage and count else [])
        if not await self._append(keys=keys, args=[record.ttl_s, *tokens]):
            raise SessionNotFound(f"session {record.session_id!r} was deleted or expired during this request")
        record.tokens.extend(tokens)

    async def refresh(self, record: SessionRecord) -> None:
        """Under the session's lock: takes what a request that held the lock since
        `record` was loaded left behind (the services' lengths). Raises SessionBusy
        if that request also committed tokens or messages, since the new turn was
        built on the old ones."""
        fresh = await self.load(record.tenant, record.session_id)
        if fresh.tokens != record.tokens or fresh.messages != record.messages:
            raise SessionBusy("the session changed while this request was being prepared; send it again")
        record.draft_len, record.target_len = fresh.draft_len, fresh.target_len

    async def save_meta(self, record: SessionRecord) -> bool:
        """Saves the history and the services' lengths; False (and nothing
        written) if the session was deleted meanwhile."""
        return bool(await self._save_meta(keys=self._keys(record)[:1], args=[
            "messages", json.dumps(record.messages), "draft_len", record.draft_len, "target_len", record.target_len]))

    async def delete(self, tenant: str, session_id: str) -> tuple[bool, str]:
        """Deletes a session; returns whether it existed, and its cache id (for
        the services' release)."""
        await self._check_owner(tenant, session_id)
        key = self._key(tenant, session_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hget(key, "cache_id")
            pipe.delete(key, f"{key}:tokens", f"tandem:owner:{session_id}")
            cache_id, removed = await pipe.execute()
        return removed > 0, stored_cache_id(cache_id, session_id)

    def lock(self, record: SessionRecord):
        """One request at a time per session (across orchestrator replicas). The
        lock expires after lock_s unless the holder commits tokens, which renew it."""
        return _SessionLock(self.redis, f"{self._key(record.tenant, record.session_id)}:lock", self.lock_s, record)

    async def close(self) -> None:
        await self.redis.aclose()


class _SessionLock:
    def __init__(self, client, key: str, timeout_s: float, record: SessionRecord):
        self._lock = client.lock(key, timeout=timeout_s, blocking=False)
        self.timeout_s = timeout_s
        self.record = record
        self._renewed = 0.0

    async def __aenter__(self):
        if not await self._lock.acquire():
            raise SessionBusy("the session is already generating; wait for that request to finish")
        self._renewed = time.monotonic()
        self.record.lock = self
        return self

    async def keep(self) -> None:
        """Renews the lock once a third of its time has passed; raises SessionBusy
        if it expired (another request may hold the session now)."""
        if time.monotonic() - self._renewed < self.timeout_s / 3:
            return
        try:
            await self._lock.reacquire()
        except redis_errors.LockError:
            raise SessionBusy(f"this request lost the session's lock (held over {self.timeout_s:g} s without "
                              "a commit); the tokens streamed so far are committed") from None
        self._renewed = time.monotonic()

    async def __aexit__(self, *exc):
        self.record.lock = None
        try:
            await self._lock.release()
        except Exception:  # expired while held (nothing to release), or Redis is down: it expires
            pass
