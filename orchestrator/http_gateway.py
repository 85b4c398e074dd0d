"""The OpenAI-compatible HTTP API (aiohttp): POST /v1/completions,
/v1/chat/completions and /v1/responses (streamed as server-sent events with
"stream": true), the stored responses and conversations
(orchestrator/responses_routes.py, orchestrator/conversations.py), GET
/v1/models, /health (and /ping), /version and /metrics (Prometheus), and
vLLM's /tokenize, /detokenize and /tokenizer_info.

A gateway: each request becomes one Generate call of the Tandem gRPC API on
the orchestrator it fronts, so admission, tenancy, checks, traces and errors
are the orchestrator's own, and gRPC's status codes become OpenAI's error
bodies. `tandem serve orchestrator --http-port` runs it in the orchestrator's
process, dialling its gRPC port on the loopback."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import json
import logging
import os
import re
import time
import uuid

import aiohttp_cors
import grpc
from aiohttp import web

from orchestrator import http_stream, reasoning_parsers
from orchestrator.openai_api import Call, chat_call, completion_call, detokenize_request, tokenize_request
from orchestrator.openai_params import ApiError
from orchestrator.openai_response import response
from orchestrator.prefix_cache import MIN_FORK
from orchestrator.responses_answer import Responses
from orchestrator.responses_routes import ResponsesRoutes
from tandem import serving, telemetry
from tandem.serving import MAX_MESSAGE_BYTES
from tandem.v1 import tandem_pb2, tandem_pb2_grpc

log = logging.getLogger(__name__)
TENANT_HEADER = "x-tandem-tenant"
REQUEST_ID_HEADER = "X-Request-Id"  # the client's, or one made up; answered, and passed on as gRPC metadata
REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces
TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context, passed on as gRPC metadata
INFO_TIMEOUT_S = 10.0


def reasoned(call: Call, parser: str | None) -> Call:
    """A chat call whose answer's reasoning is read apart, where the server
    has a reasoning parser. A grammar that shapes the answer (a format, a
    forced tool call) waits for the reasoning's end, as vLLM's does. The
    orchestrator counts the reasoning's tokens (usage's reasoning_tokens) and
    says whether the prompt closed it (TokenDelta.after_in_prompt)."""
    if parser is None:
        return call
    reasoning = call.request.params.reasoning
    reasoning.end = reasoning_parsers.END
    if reasoning_parsers.opens_itself(parser):
        reasoning.start = reasoning_parsers.START
    if call.request.params.HasField("structured_output"):
        call.request.params.structured_output.after = reasoning_parsers.END
    return dataclasses.replace(call, reasoning_parser=parser)


class Gateway:
    """Serves the HTTP API for the orchestrator at `grpc_address`.
    `served_model_name` is the model id that /v1/models lists and requests may
    name; empty = the target model's id, as the orchestrator reports it.
    `allowed_origins`: the web origins ("https://chat.example.com", or "*")
    whose pages' scripts may call it (CORS); none by default.
    `reasoning_parser`: chat answers' reasoning goes out apart (reasoning_parsers).
    `tokens_as_ids`: log probabilities name tokens "token_id:ID", where a
    request does not say (vLLM's return_tokens_as_token_ids)."""

    def __init__(self, grpc_address: str, served_model_name: str = "", tool_call_parser: str | None = None,
                 allowed_origins: tuple[str, ...] = (), reasoning_parser: str | None = None,
                 tokens_as_ids: bool = False):
        self.channel = serving.insecure_channel(grpc_address)
        self.tool_call_parser = tool_call_parser or None  # tool_choice "auto" (orchestrator.tool_parsers)
        self.reasoning_parser = reasoning_parser or None  # chat: reasoning_content (orchestrator.reasoning_parsers)
        self.tokens_as_ids = tokens_as_ids  # log probabilities name tokens "token_id:ID" (a request may say otherwise)
        self.stub = tandem_pb2_grpc.TandemStub(self.channel)
        self._model = served_model_name
        self._info: tandem_pb2.ServerInfo | None = None  # the target's facts, fixed while the orchestrator runs
        self._finishing: set[asyncio.Task] = set()  # calls read to their end after their final event
        # A body as large as a gRPC message (aiohttp's default is 1 MiB: a long
        # conversation, or a long prompt as token ids, would not fit).
        self.app = web.Application(middlewares=[self._request_id, self._errors], client_max_size=MAX_MESSAGE_BYTES)
        self.app.on_response_prepare.append(self._answer_request_id)
        self.app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            *ResponsesRoutes(self).routes(),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model}", self.model),
            web.get("/health", self.health),
            web.get("/ping", self.health),  # SageMaker's and vLLM's name for the probe
            web.post("/ping", self.health),
            web.get("/version", self.version),
            web.get("/metrics", self.metrics),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.get("/tokenizer_info", self.tokenizer_info),
        ])
        if allowed_origins:  # browsers on these origins may call every route (CORS, with its preflights)
            cors = aiohttp_cors.setup(self.app, defaults={origin: aiohttp_cors.ResourceOptions(
                allow_headers="*", expose_headers=(REQUEST_ID_HEADER,), max_age=600) for origin in allowed_origins})
            for route in list(self.app.router.routes()):
                cors.add(route)

    async def close(self) -> None:
        await self.channel.close()

    # --- helpers -----------------------------------------------------------------------
    @web.middleware
    async def _request_id(self, request: web.Request, handler):
        """The request's id: the client's X-Request-Id where it gives a usable
        one, else a new one. Every answer carries it back (streams too), the
        orchestrator gets it as "x-request-id" metadata (its spans'
        tandem.request_id, its logs), and it is the suffix of the answer's id.
        And the request counted and timed (tandem.http.requests, .duration)."""
        given = request.headers.get(REQUEST_ID_HEADER, "")
        request["request_id"] = given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        started, status = time.perf_counter(), 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as err:
            status = err.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        finally:
            route = request.match_info.route.resource
            attributes = {"method": request.method, "route": route.canonical if route is not None else "unmatched"}
            instruments = telemetry.instruments()
            instruments.http_requests.add(1, {**attributes, "status": status})
            instruments.http_duration.record(time.perf_counter() - started, attributes)

    @staticmethod
    async def _answer_request_id(request: web.Request, response: web.StreamResponse) -> None:
        if "request_id" in request:
            response.headers[REQUEST_ID_HEADER] = request["request_id"]

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except ApiError as err:
            return web.json_response(err.body(), status=err.status)
        except grpc.aio.AioRpcError as err:
            api = ApiError.from_rpc(err)
            return web.json_response(api.body(), status=api.status)
        except web.HTTPException as err:  # aiohttp's own: an unknown path, a wrong method
            if err.status < 400:
                raise
            body = ApiError(err.status, err.reason, "invalid_request_error" if err.status < 500 else "internal_error")
            return web.json_response(body.body(), status=err.status, headers={
                k: v for k, v in err.headers.items() if k.lower() == "allow"})

    async def target_info(self) -> tandem_pb2.ServerInfo:
        """The orchestrator's ServerInfo, asked once: its target's model id,
        context window and tokenizer do not change while it runs (the draft's
        pairing may; nothing here reads it)."""
        if self._info is None:
            self._info = await self.stub.GetServerInfo(tandem_pb2.GetServerInfoRequest(), timeout=INFO_TIMEOUT_S)
        return self._info

    async def model_name(self) -> str:
        if not self._model:
            self._model = (await self.target_info()).target_model
        return self._model

    @staticmethod
    def metadata(request: web.Request) -> tuple:
        pairs = [(TENANT_HEADER, request.headers.get(TENANT_HEADER, "")),
                 ("authorization", request.headers.get("Authorization", ""))]
        pairs += [(name, request.headers.get(name, "")) for name in TRACE_HEADERS]
        pairs.append(("x-request-id", request.get("request_id", "")))
        return tuple((k, v) for k, v in pairs if v)

    @staticmethod
    async def body(request: web.Request):
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ApiError(400, f"the request body is not valid JSON: {err}") from err

    # --- routes --------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.answer(request, completion_call(await self.body(request)))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.answer(request, self.reasoned(chat_call(await self.body(request), self.tool_call_parser)))

    def reasoned(self, call: Call) -> Call:
        return reasoned(call, self.reasoning_parser)

    async def _model_card(self) -> dict:
        name = await self.model_name()
        info = await self.target_info()
        return {"id": name, "object": "model", "created": 0, "owned_by": "tandem", "root": info.target_model,
                "max_model_len": info.max_context}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [await self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{model}: the served model's card, else a 404."""
        card = await self._model_card()
        if request.match_info["model"] != card["id"]:
            raise ApiError(404, f"the model {request.match_info['model']!r} does not exist: this server serves "
                                f"{card['id']!r}", "not_found_error", "model", "model_not_found")
        return web.json_response(card)

    @staticmethod
    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": _version()})

    @staticmethod
    async def metrics(request: web.Request) -> web.Response:
        """Prometheus' scrape: what the metrics port serves, in the format the
        Accept header asks for; a 404 while the orchestrator exports no metrics.
        Collected off the event loop, which runs the generations' rounds."""
        exposition = await asyncio.to_thread(telemetry.prometheus_exposition, request.headers.get("Accept", ""))
        if exposition is None:
            raise ApiError(404, "metrics are off: start the orchestrator with --metrics-port PORT, or with "
                                "--metrics-port equal to --http-port to serve them here alone", "not_found_error")
        body, content_type = exposition
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: {"prompt": text} or {"messages": [...]} (rendered
        with the chat template and the assistant's prompt), and
        "add_special_tokens" (default true) -> {"count", "max_model_len", "tokens"}."""
        body = await self.body(request)
        tokenize = tokenize_request(body)
        reply = await self.stub.Tokenize(tokenize, metadata=self.metadata(request))
        info = await self.target_info()
        return web.json_response({"count": len(reply.token_ids), "max_model_len": info.max_context,
                                  "tokens": list(reply.token_ids), "token_strs": None})

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: {"tokens": [...]} -> {"prompt": text}."""
        body = await self.body(request)
        reply = await self.stub.Tokenize(detokenize_request(body), metadata=self.metadata(request))
        return web.json_response({"prompt": reply.text})

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        """vLLM's /tokenizer_info: the special tokens and the chat template."""
        info = await self.target_info()
        if not info.has_tokenizer:
            raise ApiError(404, "the model has no tokenizer", "not_found_error")
        t = info.tokenizer
        return web.json_response({"tokenizer_class": t.tokenizer_class, "eos_token": t.eos_token or None,
                                  "bos_token": t.bos_token or None, "pad_token": t.pad_token or None,
                                  "chat_template": t.chat_template or None, "model_max_length": info.max_context})

    async def health(self, request: web.Request) -> web.Response:
        """200 while the orchestrator answers with its model pair, else 503."""
        try:
            info = await self.stub.GetServerInfo(tandem_pb2.GetServerInfoRequest(), timeout=INFO_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            return web.json_response({"status": "unavailable", "reason": err.details() or err.code().name},
                                     status=503)
        return web.json_response({"status": "ok", "target_model": info.target_model,
                                  "draft_model": info.draft_model})

    async def answer(self, request: web.Request, call: Call, shape: Responses | None = None) -> web.StreamResponse:
        """One Generate call for each of the request's choices, at once; where
        they begin alike and the orchestrator reuses prefixes, the first goes
        ahead until its first event (shares_prefix). `shape`: the answer is a
        Response (the Responses API), not a chat completion."""
        if call.tokens_as_ids is None:
            call = dataclasses.replace(call, tokens_as_ids=self.tokens_as_ids)
        model = await self.model_name()
        if call.model is not None and call.model != model:
            raise ApiError(404, f"the model {call.model!r} does not exist: this server serves {model!r}",
                           "not_found_error", "model", "model_not_found")
        metadata = self.metadata(request)
        requests = call.requests()
        ahead = shares_prefix(call) and (await self.target_info()).prefix_cache_sessions > 0
        rpcs, streams = [], []
        finished = False
        try:
            for i, one in enumerate(requests):
                rpcs.append(self.stub.Generate(one, metadata=metadata))
                streams.append(rpcs[-1].__aiter__())
                if ahead and i == 0 and len(requests) > 1:
                    # The first goes ahead: once its first event is here, both services
                    # hold its prompt, and the others copy it instead of prefilling it.
                    streams[0] = http_stream.with_first(await anext(streams[0], None), streams[0])
            if call.stream:
                answer = await http_stream.stream_answer(request, call, model, rpcs, streams, shape)
            else:
                answers = await http_stream.gather_all([http_stream.collect(events) for events in streams])
                whole = response(call, model, answers, request.get("request_id"))
                if shape is not None:
                    whole = shape.whole(whole)
                    await shape.keep(whole)
                answer = web.json_response(whole)
            finished = True
            return answer
        finally:
            for rpc, events in zip(rpcs, streams):
                if finished:  # the orchestrator is deleting the session: the call ends by itself
                    self._let_finish(events)
                else:  # the client went away, or a call failed: stop the generations
                    rpc.cancel()

    def _let_finish(self, events) -> None:
        """Reads a call to its end in the background (grpc.aio cancels a call
        that is dropped before it ends)."""
        async def drain():
            with contextlib.suppress(grpc.aio.AioRpcError):
                async for _ in events:
                    pass

        task = asyncio.create_task(drain())
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

def _version() -> str:
    try:
        return importlib.metadata.version("tandem")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown"


SHARED_TEXT = 64  # characters: a text prompt this long is worth sharing (about MIN_FORK tokens)


def shares_prefix(call: Call) -> bool:
    """Whether the call's choices begin alike, long enough that its first
    going ahead lets the others copy its prompt's caches (PrefixCache.share)
    rather than prefill it each: n > 1 of a long prompt, or a batch of
    completions whose prompts share a long beginning (lm-evaluation-harness's
    continuations of one context, say); not with a seed and sampling."""
    prompts = call.prompts
    params = call.request.params
    if call.choices < 2 or (params.HasField("seed") and params.temperature > 0):
        # A seeded sampled choice is drawn as the same seed draws it cold: a copied
        # cache's rows may differ in the last bits (see the README), and so its draws.
        return False
    if all(p.WhichOneof("prompt") == "token_ids" for p in prompts):
        return len(os.path.commonprefix([list(p.token_ids.ids) for p in prompts])) > MIN_FORK
    if all(p.WhichOneof("prompt") == "text" for p in prompts):
        return len(os.path.commonprefix([p.text for p in prompts])) >= SHARED_TEXT
    return call.n > 1 and prompts[0].WhichOneof("prompt") in ("messages", "fill")  # a template's prompt


async def start(gateway: Gateway, host: str, port: int, ssl_context=None) -> tuple[web.AppRunner, int]:
    """Serves `gateway` on host:port (0 picks one), over TLS with `ssl_context`;
    returns the runner (its cleanup() stops it) and the port."""
    # handler_cancellation: a client that disconnects cancels its handler, and
    # with it the generation (Gateway.answer), instead of decoding for nobody.
    runner = web.AppRunner(gateway.app, access_log=None, shutdown_timeout=10.0, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    bound = runner.addresses[0][1]
    log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", "https" if ssl_context else "http", host, bound)
    return runner, bound
