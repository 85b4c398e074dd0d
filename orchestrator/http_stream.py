"""A request's Generate calls as the HTTP API's answer: collected whole
(collect), or streamed as server-sent events as their rounds commit
(stream_answer). orchestrator/http_gateway.py makes the calls."""
from __future__ import annotations

import asyncio
import json
import logging
import time

import grpc
from aiohttp import web

from orchestrator.openai_api import Call
from orchestrator.openai_chunks import Chunks
from orchestrator.openai_params import ApiError
from orchestrator.openai_response import Answer
from orchestrator.responses_answer import Responses
from tandem.v1 import tandem_pb2

log = logging.getLogger(__name__)


async def stream_answer(request: web.Request, call: Call, model: str, rpcs, streams,
                        shape: Responses | None = None) -> web.StreamResponse:
    """Server-sent events. Each choice's first event is awaited before the
    response starts, so that a refused request still gets its HTTP status;
    an error after that comes as a chunk {"error": ...}, then [DONE]. The
    choices' chunks go out as their rounds commit, interleaved. With
    `shape`, each chunk goes out as the Response stream's events (which
    end with response.completed, no [DONE])."""
    firsts = await gather_all([anext(events, None) for events in streams])
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await out.prepare(request)
    chunks = Chunks(call, model, request.get("request_id"))
    events = None if shape is None else shape.events()

    async def send(chunk: dict) -> None:
        if events is None:
            await send_event(out, chunk)
            return
        for event in events.chunk(chunk):
            await send_event(out, event, event["type"])

    for event in events.start() if events is not None else ():
        await send_event(out, event, event["type"])
    started = time.monotonic()
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, event, events) -> None:
        """The choice's events into the queue, then None (or the error)."""
        try:
            while event is not None:
                await queue.put((index, event))
                if event.HasField("final"):
                    break
                event = await anext(events, None)
            await queue.put((index, None))
        except grpc.aio.AioRpcError as err:
            await queue.put((index, err))

    pumps = [asyncio.create_task(pump(i, first, events)) for i, (first, events) in enumerate(zip(firsts, streams))]
    finals: dict[int, tandem_pb2.Completion] = {}
    try:
        ended = 0
        while ended < call.choices:
            index, event = await queue.get()
            if isinstance(event, grpc.aio.AioRpcError):
                raise event
            if event is None:
                ended += 1
            elif event.HasField("delta"):
                for chunk in chunks.delta(index, event.delta):
                    await send(chunk)
            else:
                finals[index] = event.final
                for chunk in chunks.final(index, event.final):
                    await send(chunk)
        if call.include_usage and len(finals) == call.choices:
            await send(chunks.usage([finals[i] for i in range(call.choices)]))
    except grpc.aio.AioRpcError as err:
        for rpc in rpcs:  # the other choices' generations too: the answer is over
            rpc.cancel()
        error = ApiError.from_rpc(err).body()
        if events is None:
            await send_event(out, error)
        else:
            for event in events.error(error):
                await send_event(out, event, event["type"])
            await out.write_eof()
            return out
    except (ConnectionResetError, asyncio.CancelledError):
        # The caller cancels the generations; what they committed stays committed.
        log.info("client went away after %.1f s; cancelling its generation", time.monotonic() - started)
        raise
    finally:
        for task in pumps:
            task.cancel()
    if events is not None:
        closing, final = events.closing()
        try:
            await shape.keep(final)
            closing.append(events.done(final))
        except (grpc.aio.AioRpcError, ApiError) as err:  # told, instead of a Response said kept that is not
            closing += events.error((ApiError.from_rpc(err) if isinstance(err, grpc.aio.AioRpcError)
                                     else err).body())
        for event in closing:
            await send_event(out, event, event["type"])
        await out.write_eof()
        return out
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out


async def with_first(first, events):
    """A choice's events, its first already read."""
    if first is not None:
        yield first
        async for event in events:
            yield event


async def collect(events) -> Answer:
    """A choice's events, to its final one."""
    answer = Answer()
    while (event := await anext(events, None)) is not None and event.HasField("delta"):
        answer.add(event.delta)
    if event is None:
        raise ApiError(502, "the orchestrator ended the stream without a final event", "internal_error")
    answer.final = event.final
    return answer


async def gather_all(awaitables) -> list:
    """The results of the awaitables, run at once; on the first failure the
    others are cancelled and the failure raised."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def send_event(out: web.StreamResponse, payload: dict, event: str | None = None) -> None:
    named = f"event: {event}\n".encode() if event else b""
    await out.write(named + b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")
