"""Per-tenant quotas, kept in Redis so that every orchestrator replica counts
against the same numbers (DESIGN §1: "Redis: sessions, committed tokens,
tenants, quotas").

- max_requests: Generate and Chat streams a tenant may run at once. Each
  running request holds a lease in the tenant's sorted set, renewed while it
  runs; a replica that dies leaves leases that lapse after LEASE_S.
- tokens_per_minute: tokens a tenant may commit per minute (prompts and new
  turns as they are prefilled, and generated tokens; a prefix reused from a
  parked session is not counted). Counted in one fixed window a minute, by the
  same Redis call that commits each round (orchestrator.store). A request is
  refused when its tenant's window is full; one admitted runs to its end.

Keys:
  tandem:{tenant}:running         sorted set: request id by lease expiry (unix s)
  tandem:{tenant}:usage:{minute}  tokens committed in that minute (unix time // 60)
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from redis import exceptions as redis_errors

from orchestrator.config import QuotaConfig

log = logging.getLogger(__name__)
LEASE_S = 120  # a running request's lease; renewed every third of it

# KEYS: the tenant's running set. ARGV: now, the lease's expiry, the limit, the request id.
_ACQUIRE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[4])
redis.call('EXPIRE', KEYS[1], 2 * %d)
return 1
""" % LEASE_S


class QuotaExceeded(Exception):
    """A request its tenant's quota has no room for (RESOURCE_EXHAUSTED)."""


def usage_key(tenant: str, now: float | None = None) -> str:
    """The tenant's token counter for the minute of `now` (default: this one)."""
    return f"tandem:{tenant}:usage:{int((time.time() if now is None else now) // 60)}"


class TenantQuotas:
    def __init__(self, redis_client, config: QuotaConfig, lease_s: float = LEASE_S):
        self.redis = redis_client
        self.config = config
        self.lease_s = lease_s
        self._acquire = redis_client.register_script(_ACQUIRE)

    @property
    def counts_tokens(self) -> bool:
        return self.config.tokens_per_minute > 0

    @contextlib.asynccontextmanager
    async def admit(self, tenant: str):
        """Holds a place in the tenant's quotas while the block runs; raises
        QuotaExceeded, with words, when there is none."""
        await self._check_tokens(tenant)
        if not self.config.max_requests:
            yield
            return
        key, request_id = f"tandem:{tenant}:running", uuid.uuid4().hex
        now = time.time()
        if not await self._acquire(keys=[key], args=[now, now + self.lease_s, self.config.max_requests, request_id]):
            raise QuotaExceeded(f"tenant {tenant!r} already runs its limit of {self.config.max_requests} "
                                "requests at once (--tenant-max-requests); retry when one ends")
        renewing = asyncio.create_task(self._renew(key, request_id))
        try:
            yield
        finally:
            renewing.cancel()
            await asyncio.shield(self.redis.zrem(key, request_id))

    async def _renew(self, key: str, request_id: str) -> None:
        """Keeps the lease while the request runs. Redis failing here costs the
        lease at worst (the tenant may then run one request more); the request
        itself goes on, and fails on its own if Redis stays down."""
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                await self.redis.zadd(key, {request_id: time.time() + self.lease_s}, xx=True)
            except redis_errors.RedisError as err:
                log.warning("could not renew a request's lease in %s: %s", key, err)

    async def _check_tokens(self, tenant: str) -> None:
        limit = self.config.tokens_per_minute
        if not limit:
            return
        now = time.time()
        used = int(await self.redis.get(usage_key(tenant, now)) or 0)
        if used >= limit:
            raise QuotaExceeded(f"tenant {tenant!r} committed {used} tokens this minute, its limit is {limit} "
                                f"(--tenant-tokens-per-minute); retry in {60 - int(now % 60)} s")
