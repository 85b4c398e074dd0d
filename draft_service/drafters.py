"""Draft backends' contract, `Drafter.propose`, through which the server talks
to any of them, the draws they share, and prompt lookup (NgramDrafter); the
model backends are in draft_service.model_drafter.

Contract of propose: the session's history becomes prefix + new_tokens +
tokens[:-1] (the last proposed token is not part of it yet), so the
orchestrator tracks every backend the same way."""
from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from draft_service.cheap import ReducedHead
from draft_service.ngram import lookup
from tandem import rng
from tandem.distributions import SubsetDist, adjust_logits, logits_to_probs, sample
from tandem.sampling import SamplingParams
from tandem.session_cache import SessionCache, SessionCacheStore


@dataclass(frozen=True)
class ProposeCall:
    session_id: str
    prefix_len: int
    prefix_fp: int
    new_tokens: list[int]
    num_tokens: int
    sampling: SamplingParams
    return_dists: bool
    first_is_bonus_guess: bool
    alternatives: bool = False  # greedy: also return the runner-up at each position
    priority: int = 0  # the request's: the call's place in the worker's queue, the lowest first


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    token_probs: list[float]  # [k] under sampling, else []
    dists: list[torch.Tensor | SubsetDist]  # k × [vocab] (or a reduced head's subset) when asked for, else []
    prefilled: int
    cropped: int
    compute_ms: float
    step_ms: float
    alternatives: list[int] = field(default_factory=list)  # the runner-up at each position, when asked for and ranked


class Drafter(Protocol):
    vocab_size: int

    def propose(self, call: ProposeCall, cancelled: threading.Event) -> Proposal: ...


def draw(logits: torch.Tensor, call: ProposeCall, position: int, first: bool, tokens=()):
    """One drafted token from [vocab] logits at absolute `position` after
    `tokens` (the sequence before it, for penalties): (token, its probability,
    distribution); None when the request's grammar or allowed tokens leave
    no token that this draft scores (a reduced head scores only its frequent
    tokens)."""
    if call.sampling.greedy:
        ranked = adjust_logits(logits[None], call.sampling, position, tokens)[0]
        token = int(ranked.argmax())
        return None if call.sampling.masks_tokens and ranked[token] == float("-inf") else (token, None, None)
    dist = logits_to_probs(logits[None], call.sampling, position, tokens)[0]
    if call.sampling.masks_tokens and not bool(dist.isfinite().all()):  # every token scored masked: 0/0
        return None
    stream = rng.TARGET if (first and call.first_is_bonus_guess) else rng.DRAFT
    token = sample(dist, rng.uniform(call.sampling.seed, stream, position))
    return token, float(dist[token]), dist


def draw_subset(logits: torch.Tensor, head: ReducedHead, call: ProposeCall, position: int, first: bool):
    """As draw, from [len(head.token_ids)] logits of a reduced head's tokens,
    for a call that adjusts no logit (a bias, a penalty or a mask would need
    the whole vocabulary): the same token as draw over the head's logits
    spread over the vocabulary (greedy: the first of the highest, the ids
    ascending; sampled: the same cumulative masses, up to the last bits of
    the softmax's sum), and its distribution as a SubsetDist."""
    if call.sampling.greedy:
        return int(head.token_ids[int(logits.argmax())]), None, None
    probs = logits_to_probs(logits[None], call.sampling, position)[0]
    stream = rng.TARGET if (first and call.first_is_bonus_guess) else rng.DRAFT
    index = sample(probs, rng.uniform(call.sampling.seed, stream, position))
    return int(head.token_ids[index]), float(probs[index]), SubsetDist(head.ids_i32, probs, head.vocab_size)


def guess_then_fresh(cache: SessionCache, call: ProposeCall, propose_from) -> Proposal:
    """A pre-draft (bonus guess, then k) drafted as the fresh call after the guess
    would draft it: the guess alone, then, on the history with the guess, the k
    tokens that propose_from(cache, call) would propose for a call that sent the
    guess. A drafter whose choice depends on the history (prompt lookup) would
    otherwise pre-draft other tokens, or the same ones with other probabilities,
    than it drafts after a verify, and a seeded sampled run would differ with
    the pipeline on and off."""
    start = time.perf_counter()
    guess = propose_from(cache, dataclasses.replace(call, num_tokens=1))
    if len(guess.tokens) != 1:
        return guess
    cache.append(guess.tokens)
    rest = propose_from(cache, dataclasses.replace(call, new_tokens=guess.tokens, num_tokens=call.num_tokens - 1,
                                                   first_is_bonus_guess=False))
    if not rest.tokens:  # the history is the caller's prefix + new tokens, without the guess (the contract)
        cache.crop(len(cache) - 1)
    steps = [ms for ms in (guess.step_ms, rest.step_ms) if ms]
    ranked = all(len(p.alternatives) == len(p.tokens) for p in (guess, rest))
    return Proposal(guess.tokens + rest.tokens, guess.token_probs + rest.token_probs, guess.dists + rest.dists,
                    guess.prefilled, guess.cropped, guess.compute_ms + (time.perf_counter() - start) * 1e3,
                    sum(steps) / len(steps) if steps else 0.0,
                    guess.alternatives + rest.alternatives if ranked else [])


class NgramDrafter:
    """Prompt lookup over the session's own history; no model."""

    def __init__(self, store: SessionCacheStore, vocab_size: int, ngram_max: int = 4):
        self.store = store
        self.vocab_size = vocab_size
        self.ngram_max = ngram_max

    def _lookup_proposal(self, cache: SessionCache, call: ProposeCall, cropped: int, start: float) -> Proposal | None:
        tokens = lookup(cache.tokens, call.num_tokens, self.ngram_max)
        if not tokens:
            return None
        cache.append(tokens[:-1])
        greedy = call.sampling.greedy
        one_hot = []
        if not greedy and call.return_dists:
            for token in tokens:
                dist = torch.zeros(self.vocab_size)
                dist[token] = 1.0
                one_hot.append(dist)
        return Proposal(tokens, [] if greedy else [1.0] * len(tokens), one_hot, len(call.new_tokens), cropped,
                        (time.perf_counter() - start) * 1e3, 0.0)

    def _from(self, cache: SessionCache, call: ProposeCall, cropped: int) -> Proposal:
        start = time.perf_counter()
        found = self._lookup_proposal(cache, call, cropped, start)
        return found or Proposal([], [], [], len(call.new_tokens), cropped, (time.perf_counter() - start) * 1e3, 0.0)

    def propose(self, call: ProposeCall, cancelled: threading.Event) -> Proposal:
        cache, cropped = self.store.checkout(call.session_id, call.prefix_len, call.prefix_fp)
        cache.append(call.new_tokens)
        if call.first_is_bonus_guess and call.num_tokens > 1:
            proposal = guess_then_fresh(cache, call, lambda c, sub: self._from(c, sub, cropped))
        else:
            proposal = self._from(cache, call, cropped)
        self.store.enforce_budget(keep=call.session_id)
        return proposal
