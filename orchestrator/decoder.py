"""Draft→verify rounds for one request, sequential or pipelined (DESIGN §3).

The decoder yields the tokens each round commits. The caller stores them,
applies the stop conditions and stops iterating when done; closing the
generator cancels any speculative call still in flight.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator

from orchestrator.backends import DraftBlock, Proposer, Verifier, VerifyResult
from orchestrator.breaker import DraftBreaker
from orchestrator.policy import KPolicy
from orchestrator.rounds import Committed, ServiceView
from orchestrator.service_calls import PREFILL_STEP, UNDRAFTED, ServiceCalls
from tandem import telemetry
from tandem.sampling import SamplingParams

log = logging.getLogger(__name__)
PREDRAFTED, DRAFTED_AFTER = "pre-drafted", "drafted after"  # how a round's next block came


class Decoder(ServiceCalls):
    def __init__(
        self,
        proposer: Proposer,
        verifier: Verifier,
        session_id: str,
        committed: Committed,
        draft_view: ServiceView,
        target_view: ServiceView,
        sampling: SamplingParams,
        policy: KPolicy,
        pipeline: bool,
        max_context: int = 1 << 30,
        request_span=telemetry.NO_SPAN,
        breaker: DraftBreaker | None = None,
        prefill_overlap: bool = True,
        tree_width: int = 0,
        end: int = 1 << 30,
        end_ids: frozenset[int] = frozenset(),
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        plain_first: bool = False,
        priority: int = 0,
    ):
        super().__init__(proposer, verifier, session_id, committed, draft_view, target_view, sampling, max_context,
                         end, breaker, tree_width, logprobs, prompt_logprobs, priority)
        self.policy = policy
        self.pipeline = pipeline
        # The request is done once `end` tokens are committed (its max_tokens, or
        # the context window) or a round commits one of `end_ids` (EOS): blocks
        # are cut to fit, and nothing is launched after the last round.
        self.end_ids = end_ids
        self.request_span = request_span  # parent of the round spans while tracing
        self.prefill_overlap = prefill_overlap
        # With prefill_overlap: the first round decodes on the target alone,
        # beside the draft's, even with no prompt to prefill (a prompt whose
        # caches a parked session held), so that a seeded sampled request's
        # first token is a plain draw whether or not its prefix was cached.
        self.plain_first = plain_first
        self._unlearned: tuple[int, int, float, float] | None = None  # a committed round the policy has not seen
        # The target relays each verdict's next draft call to the draft
        # (target_service.relay): relay_k is the length it asked for, for the
        # verify in flight, and the draft after that verify drafts it.
        self.relays = getattr(verifier, "relays", False)
        self.relay_k = 0
        # The log probabilities (when asked for) of the tokens the last round yielded.
        self.round_logprobs: list = []

    # --- the rounds ---------------------------------------------------------
    def _launch_prefill(self, round_span) -> tuple[DraftBlock, asyncio.Task, asyncio.Task | None]:
        """A turn's first round when the target has a prompt to prefill: the
        target prefills and decodes the next token (a round of no draft tokens)
        while the draft prefills the same tokens beside it, instead of before
        it, and drafts after them. Pipelined, it pre-drafts the target's token
        (a guess) and k_ahead tokens after it; sequential, only the guess,
        which is thrown away, so that no draft work runs ahead of the target's.
        Both modes verify the same blocks, so a seeded sampled run draws the
        same random numbers at the same positions with the pipeline on and off.
        While the draft service is unavailable, the round is UNDRAFTED."""
        if not self.breaker.allows():
            return UNDRAFTED, asyncio.create_task(self._verify(UNDRAFTED, round_span)), None
        verify = asyncio.create_task(self._verify(PREFILL_STEP, round_span))
        n = 1 + (self._room(self.policy.k_ahead, ahead=1) if self.pipeline else 0)
        pre = asyncio.create_task(self._draft_beside_prefill(n, round_span))
        self.stats.predraft_attempts += self.pipeline and n > 1
        return PREFILL_STEP, verify, pre

    def _done(self, newly: list[int]) -> bool:
        """Whether the round that committed `newly` was the request's last."""
        return len(self.committed) >= self.end or not self.end_ids.isdisjoint(newly)

    def _commit(self, block: DraftBlock, result: VerifyResult) -> list[int]:
        newly = block.tokens[: result.accepted] + [result.next_token] + result.more_tokens
        if self.logprobs is not None:
            if len(result.logprobs) != len(newly):
                raise RuntimeError(f"the target service returned {len(result.logprobs)} log probabilities for "
                                   f"{len(newly)} committed tokens (a service older than the request?)")
            self.round_logprobs = result.logprobs
        if self.prompt_logprobs is not None and self.prompt_scores is None:
            self.prompt_scores = result.new_token_logprobs
        before = len(self.committed)
        self.committed.extend(newly)
        self.draft_view.settle(before, newly)
        self.target_view.settle(before, newly)
        self.stats.record(block, result)
        self.stats.undrafted_rounds += block is UNDRAFTED
        # A verify that also prefilled (a prompt, a re-sync) says nothing about the block's cost.
        verify_ms = result.compute_ms if result.prefilled <= 1 else 0.0
        if verify_ms and block.tokens:
            self.stats.verify_ms.append(verify_ms)
        if block.step_ms:
            self.stats.draft_step_ms.append(block.step_ms)
        self._unlearned = (len(block.tokens), result.accepted, block.step_ms, verify_ms)
        return newly

    def _learn(self) -> None:
        """The policy takes in the last committed round once the next round's
        calls are out, so that its choice (pipelined, 64 pairs of draft lengths
        rated: 0.086 ms hot) is off the critical path. The calls just
        launched took the lengths chosen a round before."""
        if self._unlearned is not None:
            self.policy.observe(*self._unlearned)
            self._unlearned = None

    def _launch(self, block: DraftBlock, round_span) -> tuple[asyncio.Task, asyncio.Task | None]:
        """Starts verifying `block` and, when pipelining, pre-drafting the next one.
        With the relay, the verify asks the target to start the draft after its
        verdict: the length the draft would get if asked now, within the room
        left should the whole block and the bonus token be committed."""
        drafts = bool(block.tokens) and self.breaker.allows()
        ahead = self._room(self.policy.k_ahead, ahead=len(block.tokens) + 1)
        predrafts = bool(self.pipeline and drafts and ahead)
        self.relay_k = self._room(self.policy.k, ahead=len(block.tokens) + 1) if self.relays and drafts else 0
        # Beside a pre-draft, only a rejection is relayed: after a whole block the
        # pre-draft is mostly used, and the relay would cost the next round.
        verify = asyncio.create_task(self._verify(block, round_span, self.relay_k, relay_all_accepted=not predrafts))
        pre = None
        if predrafts:
            pre = asyncio.create_task(self._predraft(block, ahead, round_span))
            self.stats.predraft_attempts += 1
        return verify, pre

    def _open_round(self, predrafted: bool):
        """The span of the next round: its draft (unless pre-drafted), its verify
        and the pre-draft launched beside that verify."""
        if not telemetry.tracing():
            return telemetry.NO_SPAN
        return telemetry.start_span("tandem.round", self.request_span, attributes={
            "tandem.round": self.stats.rounds + 1, "tandem.predraft_hit": predrafted})

    @staticmethod
    def _close_round(span, block: DraftBlock, result: VerifyResult) -> None:
        if span.is_recording():
            span.set_attributes({"tandem.k": len(block.tokens), "tandem.accepted": result.accepted})
        span.end()

    async def rounds(self) -> AsyncIterator[list[int]]:
        """Yields the tokens committed by each round, forever; the caller stops.

        The next round's calls go out before the tokens are handed over, so the
        caller's commit to Redis and its stream write overlap model work
        (handover_ms). overhead_ms of a round: the wall time from one verify's
        launch to the next, less the services' compute on that path (the
        verify's, and the draft's while the orchestrator waited for it).
        overhead_in_services_ms: the part of it in the services' handlers
        beyond their compute (the verify's, and a draft's drafted after its
        reply; a pre-draft's reply is mostly in hand when the verify's comes)."""
        tasks: list[asyncio.Task | None] = []
        span = self._open_round(predrafted=False)
        try:
            if self.prefill_overlap and (self.plain_first or self._prefills()):
                block, verify_task, pre_task = self._launch_prefill(span)
            else:
                block = await self._draft(self.policy.k, span)
                verify_task, pre_task = self._launch(block, span)
            tasks = [verify_task, pre_task]
            launched = time.perf_counter()
            while True:
                result = await verify_task
                verified_k = len(block.tokens)
                waited_ms = result.compute_ms
                in_services_ms = _in_handler(result)
                newly = self._commit(block, result)
                if self._done(newly):  # no call past the end: a verify there would hold the target for nothing
                    self._close_round(span, block, result)
                    span = telemetry.NO_SPAN
                    if pre_task is not None:
                        await _cancel(pre_task)
                    self._learn()
                    yield newly
                    return
                next_block = dropped = None
                if pre_task is not None and result.accepted < verified_k:
                    # The pre-draft assumed all of `block` accepted. The draft crops it
                    # on its next call; the task is awaited once that call is out.
                    pre_task.cancel()
                    dropped = pre_task
                elif pre_task is not None:
                    wait_start = time.perf_counter()
                    next_block = await self._take_predraft(pre_task, result)
                    waited_ms += _compute_waited(pre_task, (time.perf_counter() - wait_start) * 1e3)
                self._close_round(span, block, result)
                span = self._open_round(predrafted=next_block is not None)
                if next_block is not None:
                    block, prefetch = next_block, None
                    verify_task, pre_task = self._launch(block, span)
                    tasks = [verify_task, pre_task]
                    launched = self._launched(launched, waited_ms, in_services_ms, result, verified_k, PREDRAFTED)
                else:
                    # With the relay, the draft the target began on its verdict.
                    prefetch = asyncio.create_task(self._draft(self.relay_k or self.policy.k, span))
                    tasks = [prefetch, dropped]
                await asyncio.sleep(0)  # the calls go out before the caller's work
                self._learn()
                if dropped is not None:
                    await _cancel(dropped)
                handover_start = time.perf_counter()
                yield newly
                self.stats.handover_ms.append((time.perf_counter() - handover_start) * 1e3)
                if prefetch is not None:
                    block = await prefetch
                    # A fresh draft starts after the verify's reply and the next verify
                    # needs its block: all of its compute is on the critical path, the
                    # caller's work beside it is not.
                    waited_ms += block.compute_ms
                    in_services_ms += _in_handler(block)
                    self.stats.relayed_drafts += block.prepared
                    verify_task, pre_task = self._launch(block, span)
                    tasks = [verify_task, pre_task]
                    launched = self._launched(launched, waited_ms, in_services_ms, result, verified_k, DRAFTED_AFTER)
        finally:
            for task in tasks:
                if task is not None and not task.done():
                    await _cancel(task)
            span.end()  # the round launched when the caller stopped, its calls cancelled

    def _launched(self, previous: float, waited_ms: float, in_services_ms: float, result: VerifyResult,
                  verified_k: int, how: str) -> float:
        """Records the overhead of the round whose verify was launched at
        `previous`, now that the next verify is launched, and the part of it
        in the services' handlers; returns now."""
        now = time.perf_counter()
        wall_ms = (now - previous) * 1e3
        self.stats.overhead_ms.append(wall_ms - waited_ms)
        by_kind = self.stats.overhead_predrafted_ms if how == PREDRAFTED else self.stats.overhead_drafted_after_ms
        by_kind.append(wall_ms - waited_ms)
        self.stats.overhead_in_services_ms.append(in_services_ms)
        log.debug("round %d: k %d, accepted %d, alpha %.2f, next k %d / ahead %d, verify %.0f ms (rpc %.1f ms), "
                  "waited %.0f ms, overhead %.2f ms (in the services %.2f ms), wall %.0f ms, next block %s",
                  self.stats.rounds, verified_k, result.accepted, self.policy.alpha or 0.0, self.policy.k,
                  self.policy.k_ahead, result.compute_ms, result.latency_ms - result.compute_ms, waited_ms,
                  wall_ms - waited_ms, in_services_ms, wall_ms, how)
        return now

    async def _take_predraft(self, task: asyncio.Task, result: VerifyResult) -> DraftBlock | None:
        """After the target took all of the block that `task` pre-drafted after:
        the pre-drafted block if the target's bonus token is the guess; otherwise
        None, and the draft crops on its next call."""
        pre = await task
        if pre is None:
            return None
        self.stats.draft_prefill += pre.prefilled
        # The draft now holds committed[:-1] + pre.tokens[:-1].
        if len(pre.tokens) > 1 and pre.tokens[0] == result.next_token:
            self.stats.predraft_hits += 1
            self.draft_view = ServiceView(len(self.committed), pre.tokens[1:-1])
            return pre.drop_first()
        self.draft_view = ServiceView(len(self.committed) - 1)
        return None


def _in_handler(reply: DraftBlock | VerifyResult) -> float:
    """Of a model call's time, what its service's handler spent beyond the
    compute (0 when the service did not report it)."""
    return max(0.0, reply.handler_ms - reply.compute_ms) if reply.handler_ms else 0.0


def _compute_waited(pre_task: asyncio.Task, wait_ms: float) -> float:
    """Of a wait for a pre-draft, the part spent on its compute: the rest,
    its reply's way back, is overhead."""
    pre = None if pre_task.cancelled() else pre_task.result()
    if pre is None:  # cancelled, or a cache miss: no compute to wait for
        return 0.0
    return max(0.0, wait_ms - (pre.latency_ms - pre.compute_ms))


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
