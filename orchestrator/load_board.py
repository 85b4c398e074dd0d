"""The model replicas' loads, shared by the orchestrator replicas through Redis.

Each orchestrator places new sessions on the least busy model replicas
(orchestrator.replicas). It knows its own sessions there exactly; the others'
it reads here. Every LOAD_S each orchestrator writes, in one hash per service
role, its own count per replica address (the sessions with a call in flight
there, or placed there and about to call), stamped with Redis's clock, and
reads back every other orchestrator's. An entry older than its stale_s
(that orchestrator stopped, or lost Redis) counts no more and is dropped.

One round trip a poll (a Lua script), Redis's clock only (the orchestrators'
clocks may differ), and nothing here is needed for a correct output: a board
that cannot be reached leaves each orchestrator with its own count.
"""
from __future__ import annotations

import json
import math
import uuid

KEY = "tandem:replica-load:{role}"  # a hash: orchestrator id -> "<redis time> <its stale_s> <json loads>"

# KEYS[1] the role's hash; ARGV: this orchestrator's id, its entry (without
# the time), the hash's expiry in seconds (when every orchestrator is gone).
# Returns Redis's time ("s.us") and the whole hash.
_SHARE = """
local t = redis.call('TIME')
local now = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
redis.call('HSET', KEYS[1], ARGV[1], now .. ' ' .. ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return {now, redis.call('HGETALL', KEYS[1])}
"""


class LoadBoard:
    """One orchestrator's place on the board of one service role ("target",
    "draft"); `redis` a redis.asyncio client. Entries older than stale_s
    (this orchestrator's, which the others read) are not counted."""

    def __init__(self, redis, role: str, stale_s: float, orchestrator_id: str | None = None):
        self.redis, self.role, self.stale_s = redis, role, stale_s
        self.id = orchestrator_id or uuid.uuid4().hex
        self.key = KEY.format(role=role)
        self._share = redis.register_script(_SHARE)

    async def share(self, loads: dict[str, int]) -> dict[str, int]:
        """Writes this orchestrator's sessions per replica address; returns
        every other orchestrator's, summed per address (fresh entries only)."""
        expiry = max(60, math.ceil(10 * self.stale_s))
        now, fields = await self._share(keys=[self.key],
                                        args=[self.id, f"{self.stale_s} {json.dumps(loads)}", expiry])
        now = float(now)
        others: dict[str, int] = {}
        stale = []
        for name, value in zip(fields[::2], fields[1::2]):
            name = name.decode() if isinstance(name, bytes) else name
            if name == self.id:
                continue
            try:
                at, stale_s, body = (value.decode() if isinstance(value, bytes) else value).split(" ", 2)
                if now - float(at) > float(stale_s):
                    stale.append(name)
                    continue
                for address, count in json.loads(body).items():
                    others[address] = others.get(address, 0) + int(count)
            except (ValueError, TypeError, AttributeError):
                continue  # not an entry of this format (another version's): not counted, not dropped
        if stale:
            await self.redis.hdel(self.key, *stale)
        return others

    async def leave(self) -> None:
        """Takes this orchestrator's entry off (at shutdown)."""
        await self.redis.hdel(self.key, self.id)
