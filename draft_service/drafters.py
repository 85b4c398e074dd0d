"""Draft backends. The server talks to any of them through `Drafter.propose`."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from tandem import rng
from tandem.modeling import ModelRunner
from tandem.sampling import SamplingParams, logits_to_probs, sample
from tandem.session_cache import SessionCacheStore


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


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    token_probs: list[float]  # [k] under sampling, else []
    dists: list[torch.Tensor]  # k × [vocab] when asked for, else []
    prefilled: int
    cropped: int
    compute_ms: float
    step_ms: float


class Drafter(Protocol):
    vocab_size: int

    def propose(self, call: ProposeCall, cancelled: threading.Event) -> Proposal: ...


def draw(logits: torch.Tensor, call: ProposeCall, position: int, first: bool):
    """One drafted token from [vocab] logits: (token, its probability, distribution)."""
    if call.sampling.greedy:
        return int(logits.argmax()), None, None
    dist = logits_to_probs(logits[None], call.sampling)[0]
    stream = rng.TARGET if (first and call.first_is_bonus_guess) else rng.DRAFT
    token = sample(dist, rng.uniform(call.sampling.seed, stream, position))
    return token, float(dist[token]), dist


class ModelDrafter:
    """Drafts autoregressively with a small causal LM on a per-session KV cache."""

    def __init__(self, runner: ModelRunner, store: SessionCacheStore):
        self.runner = runner
        self.store = store
        self.vocab_size = runner.loaded.vocab_size

    def propose(self, call: ProposeCall, cancelled: threading.Event) -> Proposal:
        start = time.perf_counter()
        cache, cropped = self.store.checkout(call.session_id, call.prefix_len, call.prefix_fp)
        tokens, probs, dists = [], [], []
        feed = call.new_tokens
        steps_ms = []
        try:
            for i in range(call.num_tokens):
                if cancelled.is_set():
                    break
                step_start = time.perf_counter()
                logits = self.runner.forward(cache.kv, feed, logits_to_keep=1)[0]  # [vocab]
                cache.append(feed)
                token, prob, dist = draw(logits, call, position=len(cache), first=i == 0)
                steps_ms.append((time.perf_counter() - step_start) * 1e3)
                tokens.append(token)
                if prob is not None:
                    probs.append(prob)
                    if call.return_dists:
                        dists.append(dist)
                feed = [token]
        except Exception:
            self.store.release(call.session_id)
            raise
        self.store.enforce_budget(keep=call.session_id)
        return Proposal(
            tokens=tokens,
            token_probs=probs,
            dists=dists,
            prefilled=len(call.new_tokens),
            cropped=cropped,
            compute_ms=(time.perf_counter() - start) * 1e3,
            step_ms=sum(steps_ms) / len(steps_ms) if steps_ms else 0.0,
        )
