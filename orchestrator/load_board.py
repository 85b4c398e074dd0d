"""The model replicas' loads, shared by the orchestrator replicas through Redis.

Each orchestrator places new sessions on the least busy model replicas
(orchestrator.replicas). It knows its own sessions there exactly; the others'
it reads here. Every LOAD_S each orchestrator writes, in one hash per service
role, its own count per replica address (its sessions whose request runs
there, or placed there and about to start), stamped with Redis's clock, and
reads back every other orchestrator's. An entry older than its stale_s
(that orchestrator stopped, or lost Redis) counts no more and is dropped.

A new session is placed on the board itself (place): one script reads every
entry, picks the least busy replica and writes this orchestrator's entry with
the new session on it, and Redis runs scripts one at a time. So two
orchestrators placing at the same moment see each other's new session, where
reading and then writing would let both pick the same idle replica.

One round trip a poll or a placement (a Lua script), Redis's clock only (the
orchestrators' clocks may differ), and nothing here is needed for a correct
output: a board that cannot be reached leaves each orchestrator with its own
count.
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


# As _SHARE, and places a new session first. ARGV[4]: this orchestrator's loads
# (json), ARGV[5]: the candidate addresses (json, in the order ties go).
# Returns Redis's time, the address chosen ("" for none) and the others' loads
# summed (json), fresh entries only.
_PLACE = """
local t = redis.call('TIME')
local now = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
local others = {}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if all[i] ~= ARGV[1] then
    local at, stale_s, body = string.match(all[i + 1], '^(%S+) (%S+) (.*)$')
    if at and tonumber(now) - tonumber(at) <= tonumber(stale_s) then
      local ok, loads = pcall(cjson.decode, body)
      if ok and type(loads) == 'table' then
        for address, n in pairs(loads) do
          if type(n) == 'number' then others[address] = (others[address] or 0) + n end
        end
      end
    end
  end
end
local mine = cjson.decode(ARGV[4])
local best, least = '', nil
for _, address in ipairs(cjson.decode(ARGV[5])) do
  local load = (others[address] or 0) + (mine[address] or 0)
  if least == nil or load < least then best, least = address, load end
end
if best ~= '' then mine[best] = (mine[best] or 0) + 1 end
redis.call('HSET', KEYS[1], ARGV[1], now .. ' ' .. ARGV[2] .. ' ' .. cjson.encode(mine))
redis.call('EXPIRE', KEYS[1], ARGV[3])
return {now, best, cjson.encode(others)}
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
        self._place = redis.register_script(_PLACE)

    def _expiry(self) -> int:
        return max(60, math.ceil(10 * self.stale_s))

    async def place(self, loads: dict[str, int], candidates: list[str]) -> tuple[str, dict[str, int]]:
        """Places a new session on the least busy of `candidates` (ties: the
        first), counting every fresh entry and this orchestrator's `loads`,
        and writes `loads` with it there, at once. Returns the address chosen
        ("" with no candidate) and the other orchestrators' loads."""
        _, chosen, others = await self._place(keys=[self.key], args=[
            self.id, str(self.stale_s), self._expiry(), json.dumps(loads), json.dumps(candidates)])
        chosen = chosen.decode() if isinstance(chosen, bytes) else chosen
        others = json.loads(others)
        return chosen, {address: int(n) for address, n in others.items()} if isinstance(others, dict) else {}

    async def share(self, loads: dict[str, int]) -> dict[str, int]:
        """Writes this orchestrator's sessions per replica address; returns
        every other orchestrator's, summed per address (fresh entries only)."""
        now, fields = await self._share(keys=[self.key],
                                        args=[self.id, f"{self.stale_s} {json.dumps(loads)}", self._expiry()])
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
