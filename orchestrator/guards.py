"""Wrappers around the orchestrator's public rpcs: what an overloaded
orchestrator, or one whose session store is down, answers."""
from __future__ import annotations

import contextlib
import functools
import inspect

import grpc

from orchestrator.quotas import QuotaExceeded
from orchestrator.store import STORE_UNAVAILABLE
from tandem import telemetry


def store_unavailable(rpc):
    """An rpc whose session store (Redis) fails to answer ends with UNAVAILABLE
    and words, not UNKNOWN. A generation commits each round before streaming
    it, so what the client received is committed."""
    async def abort(context, err):
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"the session store (Redis) is unavailable: {err}")

    if inspect.isasyncgenfunction(rpc):
        @functools.wraps(rpc)
        async def streaming(self, request, context):
            try:
                async with contextlib.aclosing(rpc(self, request, context)) as events:
                    async for event in events:
                        yield event
            except STORE_UNAVAILABLE as err:
                await abort(context, err)
        return streaming

    @functools.wraps(rpc)
    async def unary(self, request, context):
        try:
            return await rpc(self, request, context)
        except STORE_UNAVAILABLE as err:
            await abort(context, err)
    return unary


def admitted(rpc):
    """A streaming rpc that counts against max_concurrent_requests: past the
    limit it ends at once with RESOURCE_EXHAUSTED, before it touches a session,
    so that an overloaded orchestrator sheds new requests instead of slowing
    every stream it holds."""
    @functools.wraps(rpc)
    async def limited(self, request, context):
        limit = self.config.max_concurrent_requests
        if limit and self.active_requests >= limit:
            telemetry.instruments().rejected_requests.add(1, {"limit": "server"})
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the orchestrator is serving its limit of {limit} concurrent requests "
                                "(--max-concurrent-requests); retry later")
        self.active_requests += 1
        try:
            async with contextlib.aclosing(rpc(self, request, context)) as events:
                async for event in events:
                    yield event
        finally:
            self.active_requests -= 1
    return limited


def tenant_quota(rpc):
    """A streaming rpc that holds a place in its tenant's quotas
    (orchestrator.quotas, --tenant-max-requests and --tenant-tokens-per-minute)
    while it runs; without room it ends at once with RESOURCE_EXHAUSTED and
    words, before it touches a session."""
    @functools.wraps(rpc)
    async def limited(self, request, context):
        async with contextlib.AsyncExitStack() as held:
            if self.quotas is not None:
                tenant = await self._tenant(context)
                try:
                    await held.enter_async_context(self.quotas.admit(tenant))
                except QuotaExceeded as err:
                    telemetry.instruments().rejected_requests.add(1, {"limit": "tenant"})
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
            async with contextlib.aclosing(rpc(self, request, context)) as events:
                async for event in events:
                    yield event
    return limited
