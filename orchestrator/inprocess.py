"""In-process implementations of the Proposer and Verifier interfaces, calling
the services' typed cores directly: for unit tests of the orchestrator's
scheduling logic without sockets. End-to-end tests use the gRPC clients."""
from __future__ import annotations

import threading

from orchestrator.backends import DraftBlock, Prefix, ServiceCacheMiss, VerifyResult
from tandem.sampling import SamplingParams
from tandem.session_cache import CacheMiss
from tandem.distributions import decode_distributions, encode_distributions


class InProcessProposer:
    def __init__(self, drafter):
        self.drafter = drafter  # draft_service.drafters.Drafter

    async def propose(self, session_id: str, prefix: Prefix, new_tokens: list[int], k: int,
                      sampling: SamplingParams, bonus_guess: bool = False, alternatives: bool = False,
                      priority: int = 0) -> DraftBlock:
        from draft_service.drafters import ProposeCall

        call = ProposeCall(session_id, prefix.length, prefix.fingerprint, list(new_tokens), k, sampling,
                           not sampling.greedy, bonus_guess, alternatives)
        try:
            proposal = self.drafter.propose(call, threading.Event())
        except CacheMiss as miss:
            raise ServiceCacheMiss(str(miss)) from None
        distributions, distribution_ids = encode_distributions(proposal.dists)
        return DraftBlock(proposal.tokens, proposal.token_probs, distributions, proposal.prefilled,
                          proposal.compute_ms, proposal.step_ms, alternatives=proposal.alternatives,
                          distribution_ids=distribution_ids)

    async def release(self, session_id: str) -> None:
        self.drafter.store.release(session_id)

    async def fork(self, source_id: str, session_id: str, prefix: Prefix) -> bool:
        return self.drafter.store.fork(source_id, session_id, prefix.length, prefix.fingerprint)


class InProcessVerifier:
    def __init__(self, verifier):
        self.verifier = verifier  # target_service.verifier.Verifier

    async def verify(self, session_id: str, prefix: Prefix, new_tokens: list[int], block: DraftBlock,
                     sampling: SamplingParams, logprobs: int | None = None,
                     prompt_logprobs: int | None = None, priority: int = 0) -> VerifyResult:
        from target_service.verifier import VerifyCall

        dists = decode_distributions(block.distributions, block.distribution_ids) if block.distributions else None
        call = VerifyCall(session_id, prefix.length, prefix.fingerprint, list(new_tokens), list(block.tokens),
                          list(block.token_probs), dists, sampling, tuple(enumerate(block.alternatives)), logprobs,
                          prompt_logprobs)
        try:
            outcome = self.verifier.verify(call)
        except CacheMiss as miss:
            raise ServiceCacheMiss(str(miss)) from None
        return VerifyResult(outcome.accepted, outcome.next_token, list(outcome.more_tokens), outcome.prefilled,
                            outcome.compute_ms, logprobs=list(outcome.logprobs),
                            new_token_logprobs=list(outcome.new_token_logprobs))

    async def release(self, session_id: str) -> None:
        self.verifier.store.release(session_id)

    async def fork(self, source_id: str, session_id: str, prefix: Prefix) -> bool:
        return self.verifier.store.fork(source_id, session_id, prefix.length, prefix.fingerprint)
