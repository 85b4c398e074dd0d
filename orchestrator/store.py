"""Sessions and their committed tokens in Redis: the source of truth (DESIGN §2.1).

Keys (all under a tenant):
  tandem:{tenant}:session:{id}         hash: created, ttl, messages (JSON), draft_len, target_len
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


class SessionStore:
    def __init__(self, url: str, default_ttl_s: int = 3600, lock_s: int = 600):
        self.redis = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=10)
        self.default_ttl_s = default_ttl_s
        self.lock_s = lock_s

    @staticmethod
    def _key(tenant: str, session_id: str) -> str:
        return f"tandem:{tenant}:session:{session_id}"

    async def ping(self) -> None:
        await self.redis.ping()

    async def create(self, tenant: str, messages: list[dict] | None = None, ttl_s: int = 0) -> SessionRecord:
        session_id = uuid.uuid4().hex
        ttl = ttl_s or self.default_ttl_s
        key = self._key(tenant, session_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={
                "created": time.time(), "ttl": ttl, "messages": json.dumps(messages or []),
                "draft_len": 0, "target_len": 0,
            })
            pipe.expire(key, ttl)
            pipe.set(f"tandem:owner:{session_id}", tenant, ex=ttl)
            await pipe.execute()
        return SessionRecord(session_id=session_id, tenant=tenant, tokens=[], messages=list(messages or []), ttl_s=ttl)

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
        )

    async def append_tokens(self, record: SessionRecord, tokens: list[int]) -> None:
        """Commits tokens (one round trip) and refreshes the TTL."""
        key = self._key(record.tenant, record.session_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            if tokens:
                pipe.rpush(f"{key}:tokens", *tokens)
            pipe.expire(f"{key}:tokens", record.ttl_s)
            pipe.expire(key, record.ttl_s)
            pipe.expire(f"tandem:owner:{record.session_id}", record.ttl_s)
            await pipe.execute()
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

    async def save_meta(self, record: SessionRecord) -> None:
        await self.redis.hset(self._key(record.tenant, record.session_id), mapping={
            "messages": json.dumps(record.messages),
            "draft_len": record.draft_len,
            "target_len": record.target_len,
        })

    async def delete(self, tenant: str, session_id: str) -> bool:
        await self._check_owner(tenant, session_id)
        key = self._key(tenant, session_id)
        removed = await self.redis.delete(key, f"{key}:tokens", f"tandem:owner:{session_id}")
        return removed > 0

    def lock(self, record: SessionRecord):
        """One request at a time per session (across orchestrator replicas)."""
        return _SessionLock(self.redis, f"{self._key(record.tenant, record.session_id)}:lock", self.lock_s)

    async def close(self) -> None:
        await self.redis.aclose()


class _SessionLock:
    def __init__(self, client, key: str, timeout_s: int):
        self._lock = client.lock(key, timeout=timeout_s, blocking=False)

    async def __aenter__(self):
        if not await self._lock.acquire():
            raise SessionBusy("the session is already generating; wait for that request to finish")
        return self

    async def __aexit__(self, *exc):
        try:
            await self._lock.release()
        except Exception:  # expired while held: nothing to release
            pass
