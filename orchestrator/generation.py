"""One request: commit the new turn, run rounds, apply the stop conditions,
commit and stream what each round produced, and report the stats."""
from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from orchestrator.backends import Proposer, Verifier
from orchestrator.breaker import DraftBreaker
from orchestrator.decoder import Decoder
from orchestrator.policy import KPolicy, KPolicyConfig, PipelineChoice, StepCosts
from orchestrator.replica_load import hold
from orchestrator.request_metrics import RequestMetrics, finish_label
from orchestrator.request_params import RequestParams, closed_in_prompt
from orchestrator.rounds import Committed, ServiceView
from orchestrator.store import SessionRecord, SessionStore
from orchestrator.text import Detokenizer, cut_at_stop, first_stop, reasoning_tokens
from tandem import telemetry
from tandem.v1 import tandem_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    policy: KPolicyConfig = field(default_factory=KPolicyConfig)
    pipeline: bool | None = True  # None = auto: each request takes the mode expected to be faster (PipelineChoice)
    max_context: int = 32768
    draft_fallback: bool = True  # while the draft service is down, decode on the target alone
    # A turn's prompt: the draft prefills it beside the target (True), or
    # before it (False); None = auto: beside it unless the two services share
    # cores (Generation.cores_shared).
    prefill_overlap: bool | None = None
    tree_width: int = 0  # greedy: a block's first tokens whose runner-up is verified beside it (Decoder)


@dataclass
class TurnOutcome:
    """Filled in by Generation.run: what the turn produced."""

    ids: list[int] = field(default_factory=list)
    text: str = ""


def _event_delta(ids: list[int], text: str, logprobs=()) -> tandem_pb2.GenerateEvent:
    return tandem_pb2.GenerateEvent(delta=tandem_pb2.TokenDelta(token_ids=ids, text=text, logprobs=logprobs))


def _token_logprobs(ids: list[int], logprobs, tokenizer) -> list[tandem_pb2.TokenLogprob]:
    """TokenDelta.logprobs of `ids` from the verifies' TokenLogprobs, each
    token decoded alone."""
    def text(token: int) -> str:
        return tokenizer.decode([token]) if tokenizer is not None else ""

    return [tandem_pb2.TokenLogprob(
        token_id=token, token=text(token), logprob=lp.logprob, rank=lp.rank,
        top_logprobs=[tandem_pb2.TopLogprob(token_id=t, token=text(t), logprob=v)
                      for t, v in zip(lp.top_tokens, lp.top_logprobs)])
        for token, lp in zip(ids, logprobs)]


class Generation:
    def __init__(self, proposer: Proposer, verifier: Verifier, store: SessionStore, tokenizer,
                 eos_ids: set[int], config: EngineConfig):
        self.proposer = proposer
        self.verifier = verifier
        self.store = store
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.config = config
        # Step costs are the deployment's, learned from every request; a verify
        # beside a running pre-draft costs more, so each mode has its own.
        self.costs = {mode: StepCosts(config.policy.ema) for mode in (False, True)}
        self.pipeline_choice = PipelineChoice(config.policy, self.costs)
        self.breaker = DraftBreaker(enabled=config.draft_fallback)
        # The draft's window, once paired: past it, rounds decode on the target alone.
        self.draft_max_context: int | None = None
        # Why the paired services' prefills should not run at once (they share
        # a machine's cores: tandem.placement.shared_cores), or None.
        self.cores_shared: str | None = None

    def prefill_overlap(self, params: RequestParams | None = None) -> bool:
        """Whether the request's first round prefills on both services at once:
        the server's --prefill-overlap, and under auto unless the services share
        cores. Under auto a seeded sampled request always overlaps: the overlap
        decides whether a turn's first token is an accept test or a plain draw,
        so its seed gives the same tokens wherever the services run. No
        `params`: an unseeded request's."""
        if self.config.prefill_overlap is not None:
            return self.config.prefill_overlap
        if params is not None and params.seeded and not params.sampling.greedy:
            return True
        return self.cores_shared is None

    def pipeline_for(self, params: RequestParams) -> bool:
        """The request's pipeline field, else the server's --pipeline, else
        (auto) the mode PipelineChoice expects to be faster here."""
        if params.pipeline is not None:
            return params.pipeline
        if self.config.pipeline is not None:
            return self.config.pipeline
        return self.pipeline_choice.choose()

    def policy_for(self, params: RequestParams, pipeline: bool) -> KPolicy:
        """The request's draft lengths: its num_draft_tokens, else the server's
        policy. A seeded sampled request drafts the server's fixed k: where the
        blocks end decides which random draws make each token (an accept test
        inside a block, a plain draw at its end), so an adaptive k, which follows
        timings, would change the tokens of a seed from run to run."""
        cfg = self.config.policy
        if params.k or (params.seeded and not params.sampling.greedy):
            k = min(params.k or cfg.k, cfg.k_max)
            cfg = KPolicyConfig(k=k, k_min=min(cfg.k_min, k), k_max=cfg.k_max, adaptive=False, ema=cfg.ema)
        return KPolicy(cfg, pipelined=pipeline, costs=self.costs[pipeline])

    async def run(self, record: SessionRecord, turn: list[int], params: RequestParams,
                  outcome: TurnOutcome | None = None, span=telemetry.NO_SPAN, cached: int = 0) -> AsyncIterator:
        """Streams GenerateEvents; the last one is the Completion. The caller holds
        the session lock and has validated the context length. `span` is the
        request's (its rounds are its children while tracing). `cached`: the
        prompt's tokens before `turn`, already the session's (prefix reuse)."""
        started = time.perf_counter()
        echoed = list(record.tokens) + turn if params.echo or params.prompt_logprobs is not None else None
        await self.store.append_tokens(record, turn)  # the turn is committed first
        eos = self._end_ids(params)
        ends = eos | params.stop_token_ids  # the tokens that end the request
        sampling = params.sampling
        if sampling.penalizes or sampling.bad_words:  # over the completion: from the first generated token on
            sampling = dataclasses.replace(sampling, penalty_start=len(record.tokens))
        after_in_prompt = False
        if params.grammar:  # over the completion, ended by the request's end tokens once complete
            after_in_prompt = closed_in_prompt(record.tokens, params.grammar_after, self.tokenizer)
            sampling = dataclasses.replace(sampling, grammar=params.grammar, grammar_start=len(record.tokens),
                                           grammar_end_ids=tuple(sorted(ends)),
                                           grammar_after=() if after_in_prompt else params.grammar_after)
        # The prompt closed the reasoning itself: the completion has none.
        reasoning_closed = closed_in_prompt(record.tokens, params.reasoning_end_ids, self.tokenizer)
        if params.min_tokens:  # the first generated token is at position len(record.tokens)
            sampling = dataclasses.replace(sampling, suppress_ids=tuple(sorted(ends)),
                                           suppress_before=len(record.tokens) + params.min_tokens)
        pipeline = self.pipeline_for(params)
        committed = Committed(record.tokens)
        decoder = Decoder(
            self.proposer, self.verifier, record.cache_id, committed,
            ServiceView(record.draft_len), ServiceView(record.target_len),
            sampling, self.policy_for(params, pipeline), pipeline,
            min(self.config.max_context, self.draft_max_context or self.config.max_context), span,
            self.breaker, self.prefill_overlap(params), self.config.tree_width,
            end=min(self.config.max_context, len(record.tokens) + params.max_tokens),
            end_ids=ends, logprobs=params.logprobs,
            prompt_logprobs=params.prompt_logprobs, plain_first=params.seeded and not params.sampling.greedy,
            priority=params.priority,
        )
        metrics = RequestMetrics(telemetry.instruments())
        detok = Detokenizer(self.tokenizer, params.skip_special_tokens)
        streamed = ""  # the completion's text sent so far
        completion: list[int] = []
        finish = tandem_pb2.FINISH_REASON_UNSPECIFIED
        stopped_by: str | int | None = None  # the stop string or stop token that ended it (vLLM's stop_reason)
        first_token_ms = 0.0
        room = self.config.max_context - len(record.tokens)
        rounds = decoder.rounds()
        unhold = hold((self.proposer, self.verifier), record.cache_id)  # the request counts on its replicas
        try:
            async for newly in rounds:
                keep, finish, stopped_by = self._cut(newly, completion, params, room, eos)
                if keep:
                    await self.store.append_tokens(record, keep)
                    completion.extend(keep)
                    detok.add(keep)
                    if finish == tandem_pb2.FINISH_REASON_STOP:
                        visible = cut_at_stop(detok.full_text(), params.stop, params.include_stop)
                    elif finish == tandem_pb2.FINISH_REASON_UNSPECIFIED and not params.include_stop:
                        visible = _short_of_stop(detok.text, params.stop)
                    else:
                        visible = detok.text
                    text, streamed = visible[len(streamed):], visible
                    if not first_token_ms:
                        first_token_ms = (time.perf_counter() - started) * 1e3
                    logprobs = (() if params.logprobs is None
                                else _token_logprobs(keep, decoder.round_logprobs, self.tokenizer))
                    event = _event_delta(keep, text, logprobs)
                    if len(completion) == len(keep):  # the first delta
                        event.delta.prompt_tokens = cached + len(turn)
                        event.delta.after_in_prompt = (reasoning_closed if params.reasoning_end_ids
                                                       else after_in_prompt)
                    if echoed is not None:
                        event.delta.prompt.CopyFrom(self._echo(echoed, decoder, params))
                        echoed = None
                    yield event
                    metrics.streamed(len(keep), first_token_ms)
                metrics.record_rounds(decoder.stats)  # while the next round's calls run
                if finish != tandem_pb2.FINISH_REASON_UNSPECIFIED:
                    break
        finally:
            await rounds.aclose()
            unhold()
            metrics.finish(decoder.stats, finish, len(completion), cached + len(turn), cached)
            # Services may hold more than was committed; they crop on the next call.
            record.draft_len = min(decoder.draft_view.length, len(record.tokens))
            record.target_len = min(decoder.target_view.length, len(record.tokens))
            await self.store.save_meta(record)
            if span.is_recording():
                span.set_attributes({
                    "tandem.session_id": record.session_id, "tandem.prompt_tokens": cached + len(turn),
                    "tandem.cached_prompt_tokens": cached,
                    "tandem.completion_tokens": len(completion), "tandem.finish_reason": finish_label(finish),
                    "tandem.rounds": decoder.stats.rounds, "tandem.drafted": decoder.stats.drafted,
                    "tandem.accepted": decoder.stats.accepted, "tandem.pipeline": pipeline})
        stats = decoder.stats
        self.pipeline_choice.observe(stats.accepted, stats.rejected_rounds)
        reasoning = 0
        if params.reasoning_end and not reasoning_closed:
            reasoning = reasoning_tokens(completion, detok.decode, params.reasoning_end, params.reasoning_start)
        yield tandem_pb2.GenerateEvent(final=tandem_pb2.Completion(
            finish_reason=finish,
            **({"stop_string": stopped_by} if isinstance(stopped_by, str)
               else {"stop_token_id": stopped_by} if stopped_by is not None else {}),
            usage=tandem_pb2.Usage(prompt_tokens=cached + len(turn), completion_tokens=len(completion),
                                   cached_prompt_tokens=cached, reasoning_tokens=reasoning),
            session_id=record.session_id,
            stats=tandem_pb2.SpeculationStats(
                rounds=stats.rounds,
                rejected_rounds=stats.rejected_rounds,
                drafted_tokens=stats.drafted,
                accepted_tokens=stats.accepted,
                accepted_per_position=stats.accepted_per_position,
                tried_per_position=stats.tried_per_position,
                rounds_per_k=stats.rounds_per_k,
                k=decoder.policy.k,
                k_ahead=decoder.policy.k_ahead,
                mean_k=stats.k_sum / stats.rounds if stats.rounds else 0.0,
                target_prefill_tokens=stats.target_prefill,
                draft_prefill_tokens=stats.draft_prefill,
                cache_misses=stats.cache_misses,
                predraft_hits=stats.predraft_hits,
                predraft_attempts=stats.predraft_attempts,
                undrafted_rounds=stats.undrafted_rounds,
                relayed_drafts=stats.relayed_drafts,
                alternative_hits=stats.alternative_hits,
                draft_distribution_bytes=stats.distribution_bytes,
                seed=params.sampling.seed,
                total_ms=(time.perf_counter() - started) * 1e3,
                first_token_ms=first_token_ms,
                overhead_ms_p50=_median(stats.overhead_ms),
                overhead_ms_p50_predrafted=_median(stats.overhead_predrafted_ms),
                overhead_ms_p50_drafted_after=_median(stats.overhead_drafted_after_ms),
                overhead_in_services_ms_p50=_median(stats.overhead_in_services_ms),
                handover_ms_p50=_median(stats.handover_ms),
                verify_ms_p50=_median(stats.verify_ms),
                draft_step_ms_p50=_median(stats.draft_step_ms),
                pipelined=pipeline,
            ),
        ))
        if outcome is not None:
            outcome.ids = completion
            # A kept conversation's reply, as the chat template will render it again: without special tokens.
            outcome.text = (detok.full_text() if params.skip_special_tokens
                            else self.tokenizer.decode(completion, skip_special_tokens=True))
            if finish == tandem_pb2.FINISH_REASON_STOP:
                outcome.text = cut_at_stop(outcome.text, params.stop, params.include_stop)

    def _echo(self, prompt: list[int], decoder: Decoder, params: RequestParams) -> tandem_pb2.PromptEcho:
        """The prompt, as the first delta carries it back (echo, prompt_logprobs)."""
        echo = tandem_pb2.PromptEcho(token_ids=prompt,
                                     text=self.tokenizer.decode(prompt) if self.tokenizer is not None else "")
        if params.prompt_logprobs is not None:
            scores = decoder.prompt_scores or []
            if len(scores) != len(prompt) - 1:
                raise RuntimeError(f"the target service scored {len(scores)} of the prompt's {len(prompt) - 1} "
                                   "tokens after its first (a service older than the request?)")
            echo.logprobs.extend(_token_logprobs(prompt[1:], scores, self.tokenizer))
            echo.first_token = self.tokenizer.decode(prompt[:1]) if self.tokenizer is not None else ""
        return echo

    def _end_ids(self, params: RequestParams) -> frozenset[int]:
        """The tokens that end the request as end of sequence."""
        return frozenset() if params.ignore_eos else frozenset(self.eos_ids)

    def _cut(self, newly, completion, params, room, eos: frozenset[int]):
        """The part of a round's tokens to commit, the finish reason it causes,
        and for FINISH_REASON_STOP what caused it: the stop string or the stop
        token id. `eos`: the request's end-of-sequence tokens."""
        limit = min(params.max_tokens, room) - len(completion)
        at_limit = tandem_pb2.FINISH_REASON_LENGTH if params.max_tokens <= room else tandem_pb2.FINISH_REASON_CONTEXT
        # A stop string ending at a new token lies within its last tokens: a token
        # is at least a byte, a character at most 4. Decoding only those keeps the
        # check linear in the completion's length.
        window = 4 * max((len(stop) for stop in params.stop), default=0) + 8
        for i, token in enumerate(newly[:limit]):
            if token in eos:
                return newly[: i + 1], tandem_pb2.FINISH_REASON_EOS, None
            if token in params.stop_token_ids:
                return newly[: i + 1], tandem_pb2.FINISH_REASON_STOP, token
            if params.stop and self.tokenizer is not None:
                tail = (completion + newly[: i + 1])[-window:]
                text = self.tokenizer.decode(tail, skip_special_tokens=params.skip_special_tokens)
                hit = first_stop(text, params.stop)
                if hit is not None:
                    return newly[: i + 1], tandem_pb2.FINISH_REASON_STOP, hit[1]
        if len(newly) >= limit:
            return newly[:limit], at_limit, None
        return newly, tandem_pb2.FINISH_REASON_UNSPECIFIED, None


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _short_of_stop(text: str, stops) -> str:
    """text less its longest ending that a stop string could start with: that
    part is held back until the next tokens show whether the stop follows (the
    client never sees a stop string's beginning)."""
    longest = max((len(stop) for stop in stops), default=0)
    for start in range(max(0, len(text) - longest + 1), len(text)):
        if any(len(stop) > len(text) - start and stop.startswith(text[start:]) for stop in stops):
            return text[:start]
    return text
