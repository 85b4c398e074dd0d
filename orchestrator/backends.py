"""The two interfaces the orchestrator depends on, a proposer and a verifier,
and their gRPC clients. Both return frozen dataclasses."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from orchestrator.config import TRANSPORTS
from tandem import multiplex, serving, telemetry
from tandem.logprobs import TokenLogprobs
from tandem.sampling import SamplingParams
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tandem.wire import sampling_to_proto

log = logging.getLogger(__name__)


class ServiceCacheMiss(Exception):
    """The service does not hold the prefix the call named; re-sync and retry."""


class ServiceUnavailable(Exception):
    """A model service is down or timed out."""


@dataclass(frozen=True)
class Prefix:
    length: int
    fingerprint: int


@dataclass(frozen=True)
class DraftBlock:
    tokens: list[int]
    token_probs: list[float] = field(default_factory=list)  # [k] under sampling
    distributions: list = field(default_factory=list)  # k wire Distributions under sampling
    prefilled: int = 0
    compute_ms: float = 0.0
    step_ms: float = 0.0
    handler_ms: float = 0.0  # in the service's handler, compute included (0: not reported)
    latency_ms: float = 0.0  # as seen by the orchestrator
    prepared: bool = False  # the target's relay began its drafting (DraftService.Prepare)
    alternatives: list[int] = field(default_factory=list)  # greedy: a runner-up for each of the first tokens (a tree)
    distribution_ids: bytes = b""  # under sampling: the ids of the rows with shared_ids (distribution_ids_i32)

    def with_tree(self, width: int) -> "DraftBlock":
        """The block with the runner-ups of its first `width` tokens as the
        alternatives to verify beside it (none when the drafter ranked none)."""
        if not self.alternatives:
            return self
        ranked = len(self.alternatives) == len(self.tokens)
        return dataclasses.replace(self, alternatives=self.alternatives[:width] if ranked else [])

    def drop_first(self) -> "DraftBlock":
        """The block after its first token (the pre-drafted bonus guess)."""
        return DraftBlock(
            tokens=self.tokens[1:],
            token_probs=self.token_probs[1:],
            distributions=self.distributions[1:],
            distribution_ids=self.distribution_ids,
            compute_ms=self.compute_ms,
            step_ms=self.step_ms,
            handler_ms=self.handler_ms,
            alternatives=self.alternatives[1:],
        )


@dataclass(frozen=True)
class VerifyResult:
    accepted: int
    next_token: int
    more_tokens: list[int] = field(default_factory=list)  # committed after next_token (an alternative was taken)
    prefilled: int = 0
    compute_ms: float = 0.0
    handler_ms: float = 0.0  # in the service's handler, compute included (0: not reported)
    latency_ms: float = 0.0
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one for each committed token, when asked
    new_token_logprobs: list[TokenLogprobs] = field(default_factory=list)  # each new token's after the first


class Proposer(Protocol):
    async def propose(
        self, session_id: str, prefix: Prefix, new_tokens: list[int], k: int,
        sampling: SamplingParams, bonus_guess: bool = False, alternatives: bool = False, priority: int = 0,
    ) -> DraftBlock:
        """priority (passed only when not 0): the request's
        (GenerationParams.priority), the call's place in the service's queue."""

    async def release(self, session_id: str) -> None: ...

    async def fork(self, source_id: str, session_id: str, prefix: Prefix) -> bool: ...

    async def model_info(self) -> common_pb2.ModelInfo: ...


class Verifier(Protocol):
    async def verify(
        self, session_id: str, prefix: Prefix, new_tokens: list[int], block: DraftBlock,
        sampling: SamplingParams, relay_k: int = 0, relay_all_accepted: bool = False,
        relay_alternatives: bool = False, logprobs: int | None = None, prompt_logprobs: int | None = None,
        priority: int = 0,
    ) -> VerifyResult:
        """logprobs (passed only when set): the result also carries each
        committed token's log probability and those of the `logprobs` most
        likely tokens at its position (tandem.logprobs); prompt_logprobs (passed
        only when set): each new token's after the first, with as many of the
        likeliest. relay_k > 0, passed only to a verifier whose `relays` attribute is
        true (absent: false): after a rejection, and after a whole block too
        if relay_all_accepted, the target also sends the draft the call that
        drafts relay_k tokens after its verdict (target_service.relay), asking
        for runner-ups if relay_alternatives. The block's alternatives, if any,
        are verified beside it (greedy). priority (passed only when not 0): as
        Proposer.propose's."""

    async def release(self, session_id: str) -> None: ...

    async def fork(self, source_id: str, session_id: str, prefix: Prefix) -> bool:
        """session_id becomes a copy of source_id's cache cut to `prefix`;
        False when the service does not hold it there (or does not answer)."""

    async def model_info(self) -> common_pb2.ModelInfo: ...


def _translate(err: grpc.aio.AioRpcError) -> Exception:
    if serving.is_cache_miss(err):
        return ServiceCacheMiss(err.details())
    if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return ServiceUnavailable(f"{err.code().name}: {err.details()}")
    return err


class _GrpcClient:
    """transport "stream" sends the model calls (Propose, Verify) on one
    long-lived stream per client (tandem.multiplex), "unary" as one rpc each."""

    def __init__(self, address: str, stub_class, timeout_s: float, transport: str, method: str, call_type,
                 tls: tuple = (None, "")):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.address = address
        self.channel = serving.service_channel(address, *tls)  # tls: (channel credentials, server name)
        self.stub = stub_class(self.channel)
        self.timeout_s = timeout_s
        self.unary = getattr(self.stub, method)
        self.calls = (multiplex.CallStream(getattr(self.stub, method + "Stream"), call_type, method)
                      if transport == "stream" else None)

    async def _call(self, request):
        """The model call, translated: ServiceCacheMiss, ServiceUnavailable, or the rpc error."""
        metadata = telemetry.outgoing_metadata()
        try:
            if self.calls is None:
                return await self.unary(request, timeout=self.timeout_s, metadata=metadata)
            return await self.calls.call(request, self.timeout_s, metadata)
        except grpc.aio.AioRpcError as err:
            raise _translate(err) from None

    async def release(self, session_id: str) -> None:
        try:
            await self.stub.ReleaseSession(
                common_pb2.ReleaseSessionRequest(session_id=session_id), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError:
            pass  # a cache is disposable; the TTL reclaims it

    async def fork(self, source_id: str, session_id: str, prefix: Prefix) -> bool:
        request = common_pb2.ForkSessionRequest(
            source_session_id=source_id, session_id=session_id,
            prefix=common_pb2.PrefixRef(length=prefix.length, fingerprint=prefix.fingerprint))
        try:
            return (await self.stub.ForkSession(request, timeout=self.timeout_s)).forked
        except grpc.aio.AioRpcError as err:
            log.warning("fork of session %s on %s failed: %s", source_id, self.address, err.details())
            return False

    async def model_info(self) -> common_pb2.ModelInfo:
        try:
            return await self.stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as err:
            raise _translate(err) from None

    async def stats(self) -> common_pb2.ServiceStats:
        return await self.stub.GetStats(common_pb2.GetStatsRequest(), timeout=self.timeout_s)

    async def close(self) -> None:
        if self.calls is not None:
            await self.calls.close()
        await self.channel.close()


class GrpcProposer(_GrpcClient):
    def __init__(self, address: str, timeout_s: float = 120.0, transport: str = "stream", tls: tuple = (None, "")):
        super().__init__(address, draft_pb2_grpc.DraftServiceStub, timeout_s, transport, "Propose",
                         draft_pb2.ProposeCall, tls)

    async def propose(self, session_id, prefix, new_tokens, k, sampling, bonus_guess=False, alternatives=False,
                      priority=0):
        request = draft_pb2.ProposeRequest(
            session_id=session_id,
            prefix=common_pb2.PrefixRef(length=prefix.length, fingerprint=prefix.fingerprint),
            new_tokens=new_tokens,
            num_tokens=k,
            sampling=sampling_to_proto(sampling),
            return_distributions=not sampling.greedy,
            first_is_bonus_guess=bonus_guess,
            return_alternatives=alternatives,
            priority=priority,
        )
        start = time.perf_counter()
        reply = await self._call(request)
        return DraftBlock(
            tokens=list(reply.tokens),
            token_probs=list(reply.token_probs),
            distributions=list(reply.distributions),
            distribution_ids=reply.distribution_ids_i32,
            prefilled=reply.prefilled_tokens,
            compute_ms=reply.compute_ms,
            step_ms=reply.step_ms,
            handler_ms=reply.handler_ms,
            latency_ms=(time.perf_counter() - start) * 1e3,
            prepared=reply.prepared,
            alternatives=list(reply.alternatives),
        )


class GrpcVerifier(_GrpcClient):
    """relay_to: the draft service's address as the target reaches it, where
    verifies ask the target to relay its verdict (target_service.relay); ""
    for none."""

    def __init__(self, address: str, timeout_s: float = 120.0, transport: str = "stream", relay_to: str = "",
                 tls: tuple = (None, "")):
        super().__init__(address, target_pb2_grpc.TargetServiceStub, timeout_s, transport, "Verify",
                         target_pb2.VerifyCall, tls)
        self.relay_to = relay_to
        self.relays = bool(relay_to)

    async def verify(self, session_id, prefix, new_tokens, block, sampling, relay_k=0, relay_all_accepted=False,
                     relay_alternatives=False, logprobs=None, prompt_logprobs=None, priority=0):
        request = target_pb2.VerifyRequest(
            session_id=session_id,
            prefix=common_pb2.PrefixRef(length=prefix.length, fingerprint=prefix.fingerprint),
            new_tokens=new_tokens,
            draft_tokens=block.tokens,
            draft_probs=block.token_probs,
            draft_distributions=block.distributions,
            draft_distribution_ids_i32=block.distribution_ids,
            sampling=sampling_to_proto(sampling),
            alternative_positions=range(len(block.alternatives)),
            alternative_tokens=block.alternatives,
            return_logprobs=logprobs is not None,
            return_new_token_logprobs=prompt_logprobs is not None,
            top_logprobs=max(logprobs or 0, prompt_logprobs or 0),
            priority=priority,
        )
        if relay_k and self.relay_to:
            request.relay.draft_address = self.relay_to
            request.relay.num_tokens = relay_k
            request.relay.return_distributions = not sampling.greedy
            request.relay.after_all_accepted = relay_all_accepted
            request.relay.return_alternatives = relay_alternatives
        start = time.perf_counter()
        reply = await self._call(request)
        return VerifyResult(
            accepted=reply.accepted,
            next_token=reply.next_token,
            more_tokens=list(reply.more_tokens),
            prefilled=reply.prefilled_tokens,
            compute_ms=reply.compute_ms,
            handler_ms=reply.handler_ms,
            latency_ms=(time.perf_counter() - start) * 1e3,
            logprobs=_logprobs(reply.logprobs, logprobs),
            new_token_logprobs=_logprobs(reply.new_token_logprobs, prompt_logprobs),
        )


def _logprobs(wire, top: int | None) -> list[TokenLogprobs]:
    """TokenLogprobs from the reply, cut to the `top` likeliest asked (one
    call asks for the larger count of its two kinds)."""
    return [TokenLogprobs(lp.logprob, tuple(lp.top_tokens[:top]), tuple(lp.top_logprobs[:top]), lp.rank)
            for lp in wire]
