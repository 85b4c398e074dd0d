"""The relay: the target hands its verdict straight to the draft service.

A verify that carries a Relay (target.proto) asks the target to send, once
the verdict is known, the Propose request that drafts the block after it to
the draft service (DraftService.Prepare; draft_service.prepared). After a
rejection the draft then starts one hop and the orchestrator's work earlier
than the orchestrator's own call could start it.

Best effort throughout: a relay never delays a verify's reply, and never
fails it. Each draft address gets one long-lived client stream; requests wait
in a short queue and go out in order, and one that waited past MAX_AGE_S is
dropped (the orchestrator has asked for that draft itself by then). While an
address cannot be reached, requests are dropped and the stream is opened again
after a pause.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

import grpc

from tandem import fingerprint, serving
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)
QUEUE = 64
MAX_AGE_S = 1.0
RETRY_S = 1.0
MAX_ADDRESSES = 8


def next_request(request, accepted: int, next_token: int, more_tokens=()) -> draft_pb2.ProposeRequest:
    """The Propose request after the verdict of `request` (a VerifyRequest with
    a relay): the history the verify named, the accepted draft tokens and the
    target's token (and the one after it, where that was an alternative). The draft holds the history and all but the last draft
    token (it drafted them), so the request names that much as its prefix."""
    history = request.prefix.length + len(request.new_tokens)
    held = min(accepted, len(request.draft_tokens) - 1)
    draft = list(request.draft_tokens)
    fp = fingerprint.extend(fingerprint.extend(request.prefix.fingerprint, request.new_tokens), draft[:held])
    return draft_pb2.ProposeRequest(
        session_id=request.session_id,
        prefix=common_pb2.PrefixRef(length=history + held, fingerprint=fp),
        new_tokens=draft[held:accepted] + [next_token, *more_tokens],
        num_tokens=request.relay.num_tokens,
        sampling=request.sampling,
        return_distributions=request.relay.return_distributions,
        return_alternatives=request.relay.return_alternatives,
        priority=request.priority,
    )


class _Link:
    """One draft address: a Prepare stream fed from a queue."""

    def __init__(self, address: str):
        self.address = address
        self.queue: asyncio.Queue = asyncio.Queue(QUEUE)
        self.task: asyncio.Task | None = None
        self.down_until = 0.0

    def put(self, request) -> bool:
        if time.monotonic() < self.down_until:
            return False
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._stream())
        try:
            self.queue.put_nowait((time.monotonic(), request))
        except asyncio.QueueFull:
            return False
        return True

    async def _requests(self):
        while True:
            queued, request = await self.queue.get()
            if time.monotonic() - queued <= MAX_AGE_S:
                yield request

    async def _stream(self) -> None:
        channel = serving.insecure_channel(self.address)
        try:
            await draft_pb2_grpc.DraftServiceStub(channel).Prepare(self._requests())
        except grpc.aio.AioRpcError as err:
            log.warning("relay to the draft at %s stopped: %s %s; retrying in %.0f s", self.address,
                        err.code().name, err.details(), RETRY_S)
            self.down_until = time.monotonic() + RETRY_S
            while not self.queue.empty():
                self.queue.get_nowait()
        finally:
            await channel.close()

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass


class Relay:
    """The target's links to the draft services its verifies name."""

    def __init__(self):
        self._links: OrderedDict[str, _Link] = OrderedDict()
        self.sent = self.dropped = 0

    def send(self, address: str, request) -> None:
        """Queues `request` for the draft at `address`; never waits."""
        link = self._links.get(address)
        if link is None:
            link = self._links[address] = _Link(address)
            while len(self._links) > MAX_ADDRESSES:
                _, old = self._links.popitem(last=False)
                asyncio.get_running_loop().create_task(old.close())
        self._links.move_to_end(address)
        if link.put(request):
            self.sent += 1
        else:
            self.dropped += 1

    async def close(self) -> None:
        for link in self._links.values():
            await link.close()
        self._links.clear()
