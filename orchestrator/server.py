"""gRPC face of the orchestrator: checks requests, owns sessions, runs Generation."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

import grpc

from orchestrator import fim
from orchestrator.auth import ApiKeys, call_tenant
from orchestrator.backends import GrpcProposer, GrpcVerifier, ServiceCacheMiss, ServiceUnavailable
from orchestrator.config import OrchestratorConfig
from orchestrator.generation import Generation, TurnOutcome
from orchestrator.request_params import RequestParams, truncated
from orchestrator.guards import admitted, store_unavailable, tenant_quota
from orchestrator.lifecycle import SessionLifecycle
from orchestrator.load_board import LoadBoard
from orchestrator.pairing import Pairing, PairingError
from orchestrator.prefix_cache import PrefixCache
from orchestrator.quotas import TenantQuotas
from orchestrator.replicas import Replicas, service_client
from orchestrator.request_reader import RequestReader, read_tools, template_variables
from orchestrator.store import SessionBusy, SessionForbidden, SessionNotFound, SessionStore
from orchestrator.stored_responses import ItemStore, ResponseStore, StoredRpcs
from orchestrator.text import ChatTemplate
from tandem import serving, telemetry
from tandem.v1 import tandem_pb2, tandem_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = tandem_pb2.DESCRIPTOR.services_by_name["Tandem"].full_name
__all__ = ["OrchestratorConfig", "OrchestratorServicer", "PairingError", "build_server"]


class OrchestratorServicer(Pairing, SessionLifecycle, StoredRpcs, tandem_pb2_grpc.TandemServicer):
    def __init__(self, config: OrchestratorConfig):
        self.config = config
        tls = (None, "")
        if config.service_tls_ca:
            from tandem.tls import channel_credentials

            tls = (channel_credentials(config.service_tls_ca, config.service_tls_cert, config.service_tls_key),
                   config.service_tls_server_name)
        # Each service's replicas (orchestrator.replicas): a session's calls go to one of them.
        self.proposer = service_client(config.draft_address, lambda address: GrpcProposer(
            address, config.service_timeout_s, config.service_transport, tls), "draft", config.replica_load_s)
        self.verifier = service_client(config.target_address, lambda address: GrpcVerifier(
            address, config.service_timeout_s, config.service_transport,
            relay_to=(config.relay_address or config.draft_address) if config.relay else "", tls=tls), "target",
            config.replica_load_s)
        self.store = SessionStore(config.redis_url, config.session_ttl_s,
                                  count_usage=config.quotas.tokens_per_minute > 0)
        self.responses = ResponseStore(self.store.redis, config.response_ttl_s)  # StoredRpcs'
        for client in (self.proposer, self.verifier):  # the orchestrator replicas' sessions on each model replica
            if isinstance(client, Replicas):
                client.share_loads(LoadBoard(self.store.redis, client.role, client.stale_s))
        self.items = ItemStore(self.responses)
        self.quotas = TenantQuotas(self.store.redis, config.quotas) if config.quotas.enabled else None
        self.api_keys = ApiKeys.load(config.api_keys_file) if config.api_keys_file else None
        self.prefix_cache = (PrefixCache(self.store, config.prefix_cache, f"{config.draft_address} {config.target_address}",
                                         self._release, self._fork, self._crowded)
                             if config.prefix_cache.enabled else None)
        self.tokenizer = None
        self.template = ChatTemplate(None)
        self.fim_format: str | None = None  # the tokenizer's fill-in-the-middle format (orchestrator/fim.py)
        self.fim_ends: frozenset[int] = frozenset()  # the tokens that end a filled-in middle
        self.reader: RequestReader | None = None  # once paired
        self.generation: Generation | None = None
        self.draft_info = self.target_info = None
        self.pair_error: str | None = None
        self._pairing: asyncio.Task | None = None  # pairs a draft service that was down at start
        self._connecting = asyncio.Lock()  # the first requests connect once, not once each
        self._placing = asyncio.Lock()  # new sessions are placed one at a time (orchestrator.replicas)
        self.active_requests = 0  # Generate and Chat streams in progress

    # --- request checks -----------------------------------------------------------
    async def _ready(self, context) -> Generation:
        if self.pair_error:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.pair_error)
        if self.generation is None:
            try:
                async with self._connecting:
                    if self.generation is None:
                        await self.connect()
            except PairingError as err:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
            except ServiceUnavailable as err:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"model services unavailable: {err}")
        return self.generation

    async def _tenant(self, context) -> str:
        return await call_tenant(context, self.api_keys)

    async def _priority_floor(self, context, tenant: str, params: tandem_pb2.GenerationParams) -> int | None:
        """The tenant's priority (--tenant-priority; "*" for the tenants not
        named), None where it has none; a request that asks for an earlier one
        ends with PERMISSION_DENIED."""
        priorities = self.config.tenant_priorities
        floor = priorities.get(tenant, priorities.get("*"))
        if floor is not None and params.HasField("priority") and params.priority < floor:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"tenant {tenant!r} may ask for priority {floor} or later (a larger number), "
                                f"not {params.priority}")
        return floor

    # --- rpcs ----------------------------------------------------------------------
    @admitted
    @store_unavailable
    @tenant_quota
    async def Generate(self, request, context):
        tenant = await self._tenant(context)
        generation = await self._ready(context)
        floor = await self._priority_floor(context, tenant, request.params)
        try:
            params = self.reader.params(request.params, floor)
            messages = None
            kind = request.WhichOneof("prompt")
            if params.truncate_prompt_tokens is not None and (request.keep_session or kind == "fill"):
                raise ValueError("truncate_prompt_tokens is for stateless prompts that are not filled in the "
                                 "middle: it would cut a kept session's history, or a fill's prefix marker")
            if kind == "text":
                self.reader.need_tokenizer("a text prompt")
                prompt = self.tokenizer.encode(request.text)
            elif kind == "fill":
                self.reader.need_tokenizer("filling in the middle")
                if self.fim_format is None:
                    raise ValueError("the model's tokenizer has no fill-in-the-middle tokens: it cannot fill in "
                                     "between a prefix and a suffix")
                prompt = self.tokenizer.encode(fim.prompt(self.fim_format, request.fill.prefix, request.fill.suffix))
                if not params.ignore_eos:  # the middle ends at the model's own markers of its end
                    params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids | self.fim_ends)
            elif kind == "messages":
                own = request.messages.chat_template
                messages = self.reader.messages(request.messages.messages, own)
                tools = read_tools(request.messages.tools_json)
                variables = template_variables(request.messages.chat_template_kwargs_json)
                continues = request.messages.continue_final_message
                if request.keep_session and (tools or variables or continues or own):
                    raise ValueError("tools, chat_template_kwargs, continue_final_message and chat_template are for "
                                     "stateless requests: a session kept for Chat renders its turns without them")
                prompt = self.template.first_turn(messages, tools, continues, variables, own)
            else:
                prompt = self.reader.check_ids(list(request.token_ids.ids))
            if not prompt:
                raise ValueError("the prompt is empty")
            prompt = truncated(prompt, params, self.target_info.max_context)
            self._check_room(0, len(prompt), params)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        # The prompt's log probabilities need every prompt token run in this request.
        record, cached = await self._session_for(tenant, prompt, messages, reuse=params.prompt_logprobs is None)
        keeps_history = messages is not None and request.keep_session  # Chat may continue the conversation
        # A stateless prompt is shared once both services hold it (PrefixCache.share):
        # from the first event on, before the caller sees it.
        shares = self.prefix_cache is not None and not request.keep_session and params.prompt_logprobs is None
        shared = finished = ended = False
        final = None
        try:
            async with contextlib.aclosing(self._stream(context, generation, record, prompt[cached:], params,
                                                        TurnOutcome() if keeps_history else None, method="Generate",
                                                        added=[] if keeps_history else None, cached=cached)) as events:
                async for event in events:
                    finished = event.HasField("final")
                    if finished and not request.keep_session:
                        final = event  # held back until the session is parked (below)
                        continue
                    if shares and not shared and not finished:
                        shared = True
                        await self._share(record, prompt)
                    yield event
            if final is not None:
                # The session is parked before the caller has the final event, so
                # that a next turn sent on it finds it parked; one not parked is
                # deleted after (below).
                if self.prefix_cache is not None:
                    ended = await asyncio.shield(self._park(record, prompt if shared else None))
                yield final
        finally:
            if not request.keep_session and not ended:
                # Shielded: a client that cancels mid-way does not leave the session behind.
                # Where parking was tried at the final event (and failed), it is deleted.
                tried = final is not None and self.prefix_cache is not None
                await asyncio.shield(self._end_stateless(record, finished and not tried,
                                                         prompt if shared and not tried else None))

    @store_unavailable
    async def CreateSession(self, request, context):
        tenant = await self._tenant(context)
        await self._ready(context)
        messages = [{"role": "system", "content": request.system_prompt}] if request.system_prompt else []
        record = await self.store.create(tenant, messages, request.ttl_seconds, cache_id=await self._placed_id())
        return tandem_pb2.Session(session_id=record.session_id, committed_tokens=0)

    @admitted
    @store_unavailable
    @tenant_quota
    async def Chat(self, request, context):
        tenant = await self._tenant(context)
        generation = await self._ready(context)
        record = await self._load(context, tenant, request.session_id)
        floor = await self._priority_floor(context, tenant, request.params)
        user = None
        try:
            params = self.reader.params(request.params, floor)
            if params.echo or params.prompt_logprobs is not None or params.truncate_prompt_tokens is not None:
                raise ValueError("echo, prompt_logprobs and truncate_prompt_tokens are Generate's: a Chat turn is "
                                 "not a prompt of its own")
            if request.WhichOneof("turn") == "user_message":
                if not request.user_message:
                    raise ValueError("the user message is empty")
                self.reader.need_tokenizer("a text message")
                if not self.template.available:
                    raise ValueError("the model has no chat template: send user_token_ids")
                user = {"role": "user", "content": request.user_message}
                if record.tokens:
                    turn = self.template.next_turn(record.messages, user, record.tokens)
                else:
                    turn = self.template.first_turn([*record.messages, user])
            else:
                turn = self.reader.check_ids(list(request.user_token_ids.ids))
                if not turn:
                    raise ValueError("the new turn is empty")
            self._check_room(len(record.tokens), len(turn), params)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        outcome = TurnOutcome()
        async with contextlib.aclosing(self._stream(context, generation, record, turn, params, outcome,
                                                    method="Chat", added=[user] if user else None)) as events:
            async for event in events:
                yield event

    @store_unavailable
    async def DeleteSession(self, request, context):
        tenant = await self._tenant(context)
        await self._load(context, tenant, request.session_id)
        deleted = await self._delete(tenant, request.session_id)
        return tandem_pb2.DeleteSessionReply(deleted=deleted)

    @store_unavailable
    async def GetServerInfo(self, request, context):
        await self._ready(context)
        policy = self.config.policy
        return tandem_pb2.ServerInfo(
            target_model=self.target_info.model_id,
            draft_model=self.draft_info.model_id if self.draft_info else "",
            draft_backend=self.draft_info.backend if self.draft_info else "",
            max_context=self.target_info.max_context,
            k=policy.k, k_min=policy.k_min, k_max=policy.k_max, adaptive_k=policy.adaptive,
            pipeline=(self.generation.pipeline_choice.preferred() if self.config.pipeline is None
                      else self.config.pipeline),
            pipeline_auto=self.config.pipeline is None,
            relay=self.config.relay,
            tree_width=self.generation.config.tree_width,
            has_tokenizer=self.tokenizer is not None,
            prefill_overlap=self.generation.prefill_overlap(),
            api_keys_required=self.api_keys is not None,
            prefix_cache_sessions=self.config.prefix_cache.sessions,
            tenant_max_requests=self.config.quotas.max_requests,
            tenant_tokens_per_minute=self.config.quotas.tokens_per_minute,
            tokenizer=self._tokenizer_info(),
            fim_format=self.fim_format or "",
            default_max_tokens=self.config.default_max_tokens,
        )

    @store_unavailable
    async def Tokenize(self, request, context):
        await self._tenant(context)  # with --api-keys, a call needs a key
        await self._ready(context)
        try:
            kind = request.WhichOneof("input")
            if kind == "token_ids":
                ids = self.reader.check_ids(list(request.token_ids.ids))
                if self.tokenizer is None:
                    raise ValueError("the model has no tokenizer: its token ids have no text")
                return tandem_pb2.TokenizeReply(token_ids=ids, text=self.tokenizer.decode(ids))
            if kind == "messages":
                own = request.messages.chat_template
                messages = self.reader.messages(request.messages.messages, own)
                options = (read_tools(request.messages.tools_json), request.messages.continue_final_message,
                           template_variables(request.messages.chat_template_kwargs_json), own)
                text = self.template.first_turn_text(messages, *options)  # rendered once, then encoded
                return tandem_pb2.TokenizeReply(token_ids=self.template.encode(text), text=text)
            self.reader.need_tokenizer("a text")
            special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            return tandem_pb2.TokenizeReply(token_ids=self.tokenizer.encode(request.text, add_special_tokens=special),
                                            text=request.text)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))

    def _tokenizer_info(self) -> tandem_pb2.TokenizerInfo:
        tokenizer = self.tokenizer
        if tokenizer is None:
            return tandem_pb2.TokenizerInfo()
        template = getattr(tokenizer, "chat_template", None)
        return tandem_pb2.TokenizerInfo(
            tokenizer_class=type(tokenizer).__name__, eos_token=tokenizer.eos_token or "",
            bos_token=tokenizer.bos_token or "", pad_token=tokenizer.pad_token or "",
            chat_template=template if isinstance(template, str) else "")

    # --- helpers ---------------------------------------------------------------------
    def _check_room(self, committed: int, turn: int, params: RequestParams) -> None:
        limit = self.target_info.max_context
        if committed + turn + params.max_tokens > limit:
            raise ValueError(
                f"{committed} committed + {turn} new + max_tokens {params.max_tokens} tokens exceed "
                f"the context window of {limit}"
            )

    async def _load(self, context, tenant: str, session_id: str):
        try:
            return await self.store.load(tenant, session_id)
        except SessionNotFound as err:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(err))
        except SessionForbidden as err:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(err))

    async def _stream(self, context, generation, record, turn, params, outcome=None, method="Generate", added=None,
                      cached=0):
        """Runs the generation under the session's lock, in the request's span: the
        root of its trace, or a child of the caller's when the call carries W3C
        trace context. A finished chat turn adds the messages `added` (the user's
        turn; none when the record holds the conversation already) and the reply
        to the history before the lock is released; added=None keeps no history."""
        request_id = request_id_of(context)
        with telemetry.request_span(f"{SERVICE_NAME}/{method}", context) as span:
            if span.is_recording():
                span.set_attributes({"tandem.tenant": record.tenant, "tandem.max_tokens": params.max_tokens,
                                     "tandem.temperature": params.sampling.temperature,
                                     **({"tandem.request_id": request_id} if request_id else {})})
            try:
                async with self.store.lock(record):
                    await self.store.refresh(record)  # the record was loaded before the lock
                    # Closed here, so that the generation's own cleanup (saving the
                    # session) runs before the lock is released, even when gRPC drops
                    # this generator on a client's cancel.
                    async with contextlib.aclosing(generation.run(record, turn, params, outcome, span,
                                                                  cached)) as events:
                        async for event in events:
                            yield event
                    if added is not None:
                        record.messages += [*added, {"role": "assistant", "content": outcome.text}]
                        await self.store.save_meta(record)
            except SessionBusy as err:
                await context.abort(grpc.StatusCode.ABORTED, str(err))
            except SessionNotFound as err:
                await context.abort(grpc.StatusCode.NOT_FOUND, str(err))
            except (ServiceUnavailable, ServiceCacheMiss) as err:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"a model service failed mid-generation ({err}); the tokens streamed so far are committed",
                )
            except grpc.aio.AioRpcError as err:  # a model service refused a call: a bug, not the client's input
                log.error("a model service refused a call of session %s (request %s): %s: %s", record.session_id,
                          request_id or "-", err.code().name, err.details())
                await context.abort(
                    grpc.StatusCode.INTERNAL,
                    f"a model service refused a call ({err.code().name}: {err.details()}); "
                    "the tokens streamed so far are committed",
                )

    async def close(self) -> None:
        if self._pairing is not None:
            self._pairing.cancel()
        await asyncio.gather(self.proposer.close(), self.verifier.close())  # (they leave the load board on Redis)
        await self.store.close()


def request_id_of(context) -> str:
    """The call's "x-request-id" metadata (the HTTP API's X-Request-Id), or ""."""
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id":
            return value[:128]
    return ""


def build_server(address: str, config: OrchestratorConfig, tls=None, local_socket: str = ""):
    """Returns (server, port, health, servicer); the caller starts the server and
    may await servicer.connect() first. `tls`: a tandem.tls.ServerTls to serve
    with; `local_socket`: a Unix socket it also serves on, without TLS."""
    servicer = OrchestratorServicer(config)

    def register(server):
        tandem_pb2_grpc.add_TandemServicer_to_server(servicer, server)
        return SERVICE_NAME

    server, port, health = serving.create_server(address, [register], tls.grpc_credentials() if tls else None,
                                                 local_socket)
    return server, port, health, servicer
