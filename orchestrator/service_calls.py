"""One request's calls to the two model services (DESIGN §2, §3).

Each call sends the committed tokens past what its service is believed to
hold, re-syncs once from the whole prefix on a cache miss, and leaves the
service's view as the reply says it stands. A draft service that is down
trips the breaker: the round goes on the target alone (UNDRAFTED). The
Decoder schedules these calls into rounds.
"""
from __future__ import annotations

import logging

from orchestrator.backends import DraftBlock, Proposer, ServiceCacheMiss, ServiceUnavailable, Verifier, VerifyResult
from orchestrator.breaker import DraftBreaker
from orchestrator.rounds import Committed, RoundStats, ServiceView
from tandem import telemetry
from tandem.sampling import SamplingParams

log = logging.getLogger(__name__)
UNDRAFTED = DraftBlock(tokens=[])  # a round on the target alone: the draft service is unavailable
PREFILL_STEP = DraftBlock(tokens=[])  # a turn's first round: the target prefills and decodes, the draft prefills beside it


class ServiceCalls:
    def __init__(
        self,
        proposer: Proposer,
        verifier: Verifier,
        session_id: str,
        committed: Committed,
        draft_view: ServiceView,
        target_view: ServiceView,
        sampling: SamplingParams,
        max_context: int,
        end: int,
        breaker: DraftBreaker | None,
        tree_width: int,
        logprobs: int | None,
        prompt_logprobs: int | None,
        priority: int,
    ):
        self.proposer = proposer
        self.verifier = verifier
        self.session_id = session_id
        self.committed = committed
        self.draft_view = draft_view
        self.target_view = target_view
        self.sampling = sampling
        self.max_context = max_context
        self.end = end
        self.breaker = breaker if breaker is not None else DraftBreaker(enabled=False)
        # Greedy only: the draft's runner-ups of a block's first tree_width tokens
        # are verified beside it (a token tree one level off the block).
        self.tree_width = tree_width if sampling.greedy else 0
        # None, or how many of the most likely tokens' log probabilities to
        # report beside each committed token's (tandem.logprobs).
        self.logprobs = logprobs
        # None, or as logprobs for the committed tokens the first verify takes
        # in (after the first of them): prompt_scores once it answered.
        self.prompt_logprobs = prompt_logprobs
        self.prompt_scores: list | None = None
        # The request's priority, on each of its service calls (named only when not 0).
        self.call_extra = {"priority": priority} if priority else {}
        self.stats = RoundStats()

    def _pending(self, view: ServiceView) -> int:
        """The view's length, so that at least one committed token is sent."""
        view.length = min(view.length, len(self.committed) - 1)
        return view.length

    def _room(self, k: int, ahead: int = 0) -> int:
        """k, less what would run past the context window or the request's end
        in the verify of a block drafted `ahead` tokens past the committed ones
        (a pre-draft: the block it follows, and the bonus token)."""
        return max(0, min(k, min(self.max_context, self.end) - len(self.committed) - ahead - 1))

    async def _resynced(self, view: ServiceView, span, call):
        """call(base), sending the committed tokens after what the service is
        believed to hold; on a cache miss, once more from the whole prefix."""
        for attempt in range(2):
            base = self._pending(view)
            try:
                return await call(base)
            except ServiceCacheMiss:
                span.add_event("cache miss: re-sync")
                self.stats.cache_misses += 1
                view.length = 0
                if attempt:
                    raise

    async def _draft(self, k: int, round_span=telemetry.NO_SPAN) -> DraftBlock:
        k = self._room(k)
        if not self.breaker.allows():
            return UNDRAFTED
        if k == 0:
            return DraftBlock(tokens=[])  # a plain decoding step
        with telemetry.child_span("tandem.draft", round_span, telemetry.SpanKind.CLIENT) as span:
            try:
                block = await self._resynced(self.draft_view, span, lambda base: self.proposer.propose(
                    self.session_id, self.committed.prefix(base), self.committed.tokens[base:], k, self.sampling,
                    alternatives=self.tree_width > 0, **self.call_extra))
            except ServiceUnavailable as err:
                if not self.breaker.trip(err):
                    raise
                span.add_event("draft service unavailable: a round on the target alone")
                return UNDRAFTED
            self.breaker.reset()
            if span.is_recording():
                span.set_attributes({"tandem.k": k, "tandem.prefilled": block.prefilled,
                                     "tandem.compute_ms": block.compute_ms})
        self.stats.draft_prefill += block.prefilled
        self.draft_view.length = len(self.committed)
        self.draft_view.tail = block.tokens[:-1]
        return block

    async def _verify(self, block: DraftBlock, round_span=telemetry.NO_SPAN, relay_k: int = 0,
                      relay_all_accepted: bool = False) -> VerifyResult:
        # The keyword arguments beyond the call's own, named only when set.
        extra = {"relay_k": relay_k, "relay_all_accepted": relay_all_accepted} if relay_k else {}
        if relay_k and self.tree_width:
            extra["relay_alternatives"] = True
        extra.update(self.call_extra)
        if self.logprobs is not None:
            extra["logprobs"] = self.logprobs
        if self.prompt_logprobs is not None and self.prompt_scores is None:
            extra["prompt_logprobs"] = self.prompt_logprobs
        sent = block.with_tree(self.tree_width)
        with telemetry.child_span("tandem.verify", round_span, telemetry.SpanKind.CLIENT) as span:
            result = await self._resynced(self.target_view, span, lambda base: self.verifier.verify(
                self.session_id, self.committed.prefix(base), self.committed.tokens[base:], sent, self.sampling,
                **extra))
            if span.is_recording():
                span.set_attributes({"tandem.k": len(block.tokens), "tandem.accepted": result.accepted,
                                     "tandem.prefilled": result.prefilled, "tandem.compute_ms": result.compute_ms})
        self.stats.target_prefill += result.prefilled
        self.target_view.length = len(self.committed)
        # The target holds the accepted tokens, and the alternative it took after them.
        self.target_view.tail = block.tokens[: result.accepted] + [result.next_token] * bool(result.more_tokens)
        return result

    async def _predraft(self, block: DraftBlock, k: int, round_span=telemetry.NO_SPAN) -> DraftBlock | None:
        """Drafts the block after `block` + a guess of the bonus token, assuming all
        of `block` is accepted. None when the draft lost its cache meanwhile."""
        with telemetry.child_span("tandem.predraft", round_span, telemetry.SpanKind.CLIENT) as span:
            if span.is_recording():
                span.set_attribute("tandem.k", k + 1)  # the bonus guess, then k
            try:
                pre = await self.proposer.propose(
                    self.session_id,
                    self.committed.prefix(len(self.committed), block.tokens[:-1]),
                    block.tokens[-1:],
                    k + 1,
                    self.sampling,
                    bonus_guess=True,
                    alternatives=self.tree_width > 0,
                    **self.call_extra,
                )
                self.breaker.reset()
                return pre
            except ServiceCacheMiss:
                span.add_event("cache miss")
                log.debug("pre-draft of session %s missed", self.session_id)
                return None
            except ServiceUnavailable as err:
                if not self.breaker.trip(err):
                    raise
                span.add_event("draft service unavailable")
                return None

    def _prefills(self) -> bool:
        """Whether the target has more than one committed token to take in (a
        prompt, a new turn, a re-sync): a prefill."""
        return len(self.committed) - self._pending(self.target_view) > 1

    async def _draft_beside_prefill(self, n: int, round_span=telemetry.NO_SPAN) -> DraftBlock | None:
        """The draft takes in the committed tokens while the target prefills
        them, and drafts n tokens after them, the first a guess of the token
        the target is decoding (a pre-draft's bonus guess, then n - 1). None
        when the draft service is unavailable or lost the session twice."""
        with telemetry.child_span("tandem.predraft", round_span, telemetry.SpanKind.CLIENT) as span:
            if span.is_recording():
                span.set_attribute("tandem.k", n)
            try:
                pre = await self._resynced(self.draft_view, span, lambda base: self.proposer.propose(
                    self.session_id, self.committed.prefix(base), self.committed.tokens[base:], n, self.sampling,
                    bonus_guess=True, alternatives=self.tree_width > 0, **self.call_extra))
                self.breaker.reset()
                return pre
            except ServiceCacheMiss:
                return None
            except ServiceUnavailable as err:
                if not self.breaker.trip(err):
                    raise
                span.add_event("draft service unavailable")
                self.stats.undrafted_rounds += 1  # the round beside it went on without the draft
                return None
