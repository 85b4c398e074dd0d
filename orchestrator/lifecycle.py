"""The life of a session's caches beyond one request: where a new session is
placed, the parked sessions whose prompts later requests reuse (--prefix-cache),
and the end of a stateless request's session, parked or deleted on both model
services."""
from __future__ import annotations

import asyncio
import contextlib
import logging

from orchestrator.backends import Prefix
from orchestrator.replica_load import placed_on_board
from orchestrator.replicas import Replicas

log = logging.getLogger(__name__)


class SessionLifecycle:
    """Mixed into OrchestratorServicer, whose store, prefix_cache, proposer,
    verifier and _placing lock it uses."""

    async def _session_for(self, tenant: str, prompt: list[int], messages: list[dict] | None, reuse: bool = True):
        """A Generate's session, and how many of the prompt's first tokens it
        holds: a parked one that shares the prompt's prefix (--prefix-cache),
        else (or without `reuse`) a new one."""
        if self.prefix_cache is not None and reuse:
            taken = await self.prefix_cache.take(tenant, prompt)
            if taken is not None:
                record, cached = taken
                if messages:
                    record.messages = messages
                    await self.store.save_meta(record)
                log.debug("session %s: %d of %d prompt tokens reused", record.session_id, cached, len(prompt))
                return record, cached
        return await self.store.create(tenant, messages, cache_id=await self._placed_id()), 0

    async def _share(self, record, prompt: list[int]) -> None:
        try:
            await self.prefix_cache.share(record, prompt)
        except Exception:  # noqa: BLE001 (a Redis hiccup costs later requests a prefill, not this one its answer)
            log.warning("could not share the prompt of session %s", record.session_id, exc_info=True)

    async def _park(self, record, shared: list[int] | None) -> bool:
        """Withdraws the prompt a finished stateless request shared and parks its
        session (--prefix-cache); False when it is not parked (Redis failed, or
        the session is gone)."""
        if shared is not None:
            with contextlib.suppress(Exception):  # the live keys expire with the session's TTL anyway
                await self.prefix_cache.unshare(record, shared)
        try:
            return await self.prefix_cache.park(record)
        except Exception:  # noqa: BLE001 (Redis failed mid-way: deleted after, as without the cache)
            log.warning("could not park session %s; deleting it", record.session_id, exc_info=True)
            return False

    async def _end_stateless(self, record, finished: bool, shared: list[int] | None = None) -> None:
        """After a Generate without keep_session: withdraws the prompt it shared,
        parks a session that finished for a later prompt with the same prefix,
        and deletes any other."""
        if finished and self.prefix_cache is not None:
            if await self._park(record, shared):
                return
        elif shared is not None:
            with contextlib.suppress(Exception):  # the live keys expire with the session's TTL anyway
                await self.prefix_cache.unshare(record, shared)
        await self._delete(record.tenant, record.session_id)

    async def _release(self, cache_id: str) -> None:
        """Frees a session's caches on both services."""
        await asyncio.gather(self.proposer.release(cache_id), self.verifier.release(cache_id))

    async def _placed_id(self) -> str:
        """A new session's cache id, placed on the least busy replicas (orchestrator.replicas),
        every orchestrator's sessions counted, on the load board where it answers;
        "" (the session's id) without replicas."""
        services = [client for client in (self.verifier, self.proposer) if isinstance(client, Replicas)]
        return await placed_on_board(services, self._placing) if services else ""

    def _crowded(self, cache_id: str) -> bool:
        """Whether the replica of either service that holds a session's caches
        is busy enough that a copy of them is better placed afresh."""
        return any(isinstance(client, Replicas) and client.crowded(cache_id)
                   for client in (self.proposer, self.verifier))

    async def _fork(self, source_id: str, cache_id: str, length: int, fp: int) -> bool:
        """Copies a prefix of one session's caches into another on both
        services; True when both did (else neither keeps a copy)."""
        prefix = Prefix(length, fp)
        forked = await asyncio.gather(self.proposer.fork(source_id, cache_id, prefix),
                                      self.verifier.fork(source_id, cache_id, prefix))
        if not all(forked):
            await self._release(cache_id)
        return all(forked)

    async def _delete(self, tenant: str, session_id: str) -> bool:
        deleted, cache_id = await self.store.delete(tenant, session_id)
        await self._release(cache_id)
        return deleted
