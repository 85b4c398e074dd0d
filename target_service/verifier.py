"""Verification of one block of draft tokens on a session's cache (runs on the
model worker thread)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from tandem import rng
from tandem.acceptance import Verdict, verify_greedy, verify_greedy_tree, verify_sampled
from tandem.distributions import adjust_logits, logits_to_probs
from tandem.logprobs import TokenLogprobs, token_logprobs
from tandem.modeling import ModelRunner
from tandem.sampling import SamplingParams
from tandem.session_cache import SessionCacheStore

log = logging.getLogger(__name__)
PROMPT_CHUNK = 128  # new tokens a forward when their log probabilities are asked


@dataclass(frozen=True)
class VerifyCall:
    session_id: str
    prefix_len: int
    prefix_fp: int
    new_tokens: list[int]
    draft_tokens: list[int]
    draft_probs: list[float]  # [k], empty under greedy
    draft_dists: torch.Tensor | None  # [k, vocab] or None
    sampling: SamplingParams
    alternatives: tuple[tuple[int, int], ...] = ()  # greedy: (draft position, token) verified beside the block
    logprobs: int | None = None  # None: none; n: each committed token's log probability and the top n's
    prompt_logprobs: int | None = None  # as logprobs, for the new tokens after the first (a prompt's)
    priority: int = 0  # the request's: the call's place in the worker's queue, the lowest first


@dataclass(frozen=True)
class VerifyOutcome:
    accepted: int
    next_token: int
    prefilled: int
    cropped: int
    compute_ms: float
    more_tokens: tuple[int, ...] = ()  # committed after next_token (an alternative was taken)
    logprobs: tuple[TokenLogprobs, ...] = ()  # one for each committed token, when the call asked
    new_token_logprobs: tuple[TokenLogprobs, ...] = ()  # one for each new token after the first, when asked


class Verifier:
    def __init__(self, runner: ModelRunner, store: SessionCacheStore):
        self.runner = runner
        self.store = store

    def verify(self, call: VerifyCall) -> VerifyOutcome:
        start = time.perf_counter()
        cache, cropped = self.store.checkout(call.session_id, call.prefix_len, call.prefix_fp)
        first_draft_pos = len(cache) + len(call.new_tokens)  # absolute position of draft token 0
        cache.append(call.new_tokens + call.draft_tokens)
        tree = self._as_tree(call)
        new_token_logprobs = ()
        try:
            if call.prompt_logprobs is not None:
                new_token_logprobs = self._feed_scored(cache, call)
            verdict, logprobs = (self._verify_tree if tree else self._verify_block)(cache, call, first_draft_pos)
        except Exception:
            self.store.release(call.session_id)  # a half-written cache is never reused
            raise
        self.store.enforce_budget(keep=call.session_id)
        return VerifyOutcome(
            accepted=verdict.accepted,
            next_token=verdict.next_token,
            prefilled=len(call.new_tokens),
            cropped=cropped,
            compute_ms=(time.perf_counter() - start) * 1e3,
            more_tokens=verdict.more_tokens,
            logprobs=logprobs,
            new_token_logprobs=new_token_logprobs,
        )

    def feed(self, cache) -> None:
        """Runs the cache's unfed tokens through the model, keeping the
        logits of the last row only: a chunk of a long prefill
        (ModelServiceBase.prefill_ahead)."""
        self.runner.forward(cache.kv, cache.unfed(), logits_to_keep=1)

    def feed_scored(self, call: VerifyCall, cache) -> tuple[TokenLogprobs, ...]:
        """As feed, for a call that asks for its new tokens' log probabilities
        (prompt_logprobs): keeps every row's logits, and returns the log
        probability of each token after the chunk's first, through the first
        token after the chunk. `call`: as it came, before its chunks were
        taken off it. The chunk is at most PROMPT_CHUNK rows (their logits
        are kept together)."""
        chunk = cache.unfed()
        following = call.new_tokens[len(cache) - call.prefix_len]
        rows = self.runner.forward(cache.kv, chunk, logits_to_keep=len(chunk))  # [len(chunk), vocab]
        return token_logprobs(rows, chunk[1:] + [following], call.prompt_logprobs)

    def _as_tree(self, call: VerifyCall) -> bool:
        """Whether the call's alternatives are verified beside its block."""
        return bool(call.alternatives and call.draft_tokens and call.sampling.greedy and self.runner.verifies_trees
                    and call.prompt_logprobs is None and not call.sampling.adjusts)

    def _feed_scored(self, cache, call: VerifyCall) -> tuple[TokenLogprobs, ...]:
        """Runs the call's new tokens but the last through the model, in chunks
        of PROMPT_CHUNK, keeping every row's logits only for its chunk (a row of
        the default target's is 0.6 MB in float32), and returns the log
        probability of each new token after the first. The last new token is
        left to the block's forward, which gives the row after it."""
        unfed = cache.unfed()
        before = len(unfed) - len(call.draft_tokens)  # the new tokens
        scored = []
        for start in range(0, before - 1, PROMPT_CHUNK):
            chunk = unfed[start: min(start + PROMPT_CHUNK, before - 1)]
            rows = self.runner.forward(cache.kv, chunk, logits_to_keep=len(chunk))
            scored.extend(token_logprobs(rows, unfed[start + 1: start + 1 + len(chunk)], call.prompt_logprobs))
            cache.kv_len += len(chunk)
        return tuple(scored)

    def verify_batch(self, calls: list[VerifyCall]) -> list[VerifyOutcome | Exception]:
        """Several sessions' calls (distinct sessions) at once: their blocks go
        through one forward (runner.forward_batch) where the runner has one;
        each outcome is what verify(call) would give, or the exception it would
        raise (a cache miss fails its own call only). A call with alternatives
        to verify as a tree runs alone after the batch."""
        batch_forward = getattr(self.runner, "forward_batch", None)
        if len(calls) == 1 or batch_forward is None:
            return [self._verify_or_error(call) for call in calls]
        start = time.perf_counter()
        results: list[VerifyOutcome | Exception | None] = [None] * len(calls)
        joined = []  # (index, cache, cropped, first draft position)
        for index, call in enumerate(calls):
            if self._as_tree(call) or call.prompt_logprobs is not None:
                continue  # run alone, after the batch
            try:
                cache, cropped = self.store.checkout(call.session_id, call.prefix_len, call.prefix_fp)
            except Exception as err:  # CacheMiss
                results[index] = err
                continue
            first_draft_pos = len(cache) + len(call.new_tokens)
            cache.append(call.new_tokens + call.draft_tokens)
            joined.append((index, cache, cropped, first_draft_pos))
        if joined:
            try:
                logits = batch_forward([(cache.kv, cache.unfed(), len(calls[index].draft_tokens) + 1)
                                        for index, cache, _, _ in joined])
            except Exception as err:
                for index, *_ in joined:
                    self.store.release(calls[index].session_id)  # a half-written cache is never reused
                    results[index] = err
                joined = []
            compute_ms = (time.perf_counter() - start) * 1e3
            for (index, cache, cropped, first_draft_pos), block_logits in zip(joined, logits if joined else ()):
                call = calls[index]
                cache.mark_fed()
                verdict, logprobs = self._settle_block(cache, call, first_draft_pos, block_logits)
                self.store.enforce_budget(keep=call.session_id)
                results[index] = VerifyOutcome(accepted=verdict.accepted, next_token=verdict.next_token,
                                               prefilled=len(call.new_tokens), cropped=cropped,
                                               compute_ms=compute_ms, more_tokens=verdict.more_tokens,
                                               logprobs=logprobs)
        for index, call in enumerate(calls):
            if results[index] is None:
                results[index] = self._verify_or_error(call)
        return results

    def _verify_or_error(self, call: VerifyCall) -> VerifyOutcome | Exception:
        try:
            return self.verify(call)
        except Exception as err:
            return err

    def _verify_block(self, cache, call: VerifyCall, first_draft_pos: int) -> tuple[Verdict, tuple]:
        """The block in one forward; the cache keeps the accepted draft tokens."""
        k = len(call.draft_tokens)
        logits = self.runner.forward_block(cache.kv, cache.unfed(), k)  # [k+1, vocab]
        cache.mark_fed()
        return self._settle_block(cache, call, first_draft_pos, logits)

    def _settle_block(self, cache, call: VerifyCall, first_draft_pos: int,
                      logits: torch.Tensor) -> tuple[Verdict, tuple[TokenLogprobs, ...]]:
        """The verdict on the block from its [k+1, vocab] logits, and the
        committed tokens' log probabilities if the call asked; the cache keeps
        the accepted draft tokens."""
        assert logits.ndim == 2
        k = len(call.draft_tokens)
        if call.sampling.greedy:
            verdict = verify_greedy(call.draft_tokens,
                                    adjust_logits(logits, call.sampling, first_draft_pos, cache.tokens)
                                    .argmax(dim=-1).tolist())
        else:
            seed = call.sampling.seed
            verdict = verify_sampled(
                call.draft_tokens,
                call.draft_probs,
                None if call.draft_dists is None else call.draft_dists.to(logits.device),
                logits_to_probs(logits, call.sampling, first_draft_pos, cache.tokens),
                rng.uniforms(seed, rng.ACCEPT, first_draft_pos, k),
                rng.uniforms(seed, rng.TARGET, first_draft_pos, k + 1),
            )
        cache.crop(first_draft_pos + verdict.accepted)
        if call.logprobs is None:
            return verdict, ()
        committed = call.draft_tokens[: verdict.accepted] + [verdict.next_token]
        return verdict, token_logprobs(logits[: verdict.accepted + 1], committed, call.logprobs)

    def _verify_tree(self, cache, call: VerifyCall, first_draft_pos: int) -> tuple[Verdict, tuple]:
        """The block and its alternatives in one forward; the cache keeps the
        path the verdict takes: the accepted draft tokens, and the alternative
        taken after them (its keys and values moved into place)."""
        k = len(call.draft_tokens)
        chain, after_alternatives = self.runner.forward_tree(cache.kv, cache.unfed(), k, list(call.alternatives))
        verdict = verify_greedy_tree(call.draft_tokens, chain.argmax(dim=-1).tolist(), call.alternatives,
                                     after_alternatives.argmax(dim=-1).tolist())
        keep = first_draft_pos + verdict.accepted
        if verdict.taken is None:
            self.runner.keep_path(cache.kv, keep)
            cache.rewrite_tail(keep, [])
        else:  # the alternative's keys and values sit after the block's
            self.runner.keep_path(cache.kv, keep + 1, moved_from=first_draft_pos + k + verdict.taken)
            cache.rewrite_tail(keep, [verdict.next_token])
        if call.logprobs is None:
            return verdict, ()
        # An alternative taken stands at the chain's row `accepted` (it is the
        # target's token there); the token after it, at its own row.
        rows = chain[: verdict.accepted + 1]
        if verdict.taken is not None:
            rows = torch.cat([rows, after_alternatives[verdict.taken: verdict.taken + 1]])
        committed = call.draft_tokens[: verdict.accepted] + [verdict.next_token, *verdict.more_tokens]
        return verdict, token_logprobs(rows, committed, call.logprobs)
