"""The model draft backend: a small causal LM drafting a step at a time on a
per-session KV cache (ModelDrafter, several sessions' greedy blocks in lockstep
with propose_batch), and prompt lookup in front of it (NgramModelDrafter)."""
from __future__ import annotations

import threading
import time

import torch

from draft_service.cheap import ReducedHead
from draft_service.drafters import NgramDrafter, Proposal, ProposeCall, draw, draw_subset, guess_then_fresh
from tandem.distributions import adjust_logits
from tandem.lean import LeanRunner
from tandem.modeling import ModelRunner
from tandem.session_cache import SessionCache, SessionCacheStore


class StepAborted(Exception):
    """A draft step stopped between two layers: its call was cancelled."""


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (model.model.layers and
    the like); [] where the model does not have them in that place."""
    layers = getattr(getattr(model, "base_model", model), "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


class _Block:
    """One call's block as a model drafts it, a step at a time: alone
    (ModelDrafter._draft) or beside other sessions' blocks (propose_batch)."""

    def __init__(self, drafter: "ModelDrafter", cache: SessionCache, call: ProposeCall, cropped: int, start: float):
        self.drafter, self.cache, self.call, self.cropped, self.start = drafter, cache, call, cropped, start
        self.tokens: list[int] = []
        self.probs: list[float] = []
        self.dists: list[torch.Tensor] = []
        self.steps_ms: list[float] = []
        self.runners_up: list[int] = []
        self.ranks = call.alternatives and call.sampling.greedy
        # The step's logits over the reduced head's tokens alone (ModelDrafter.subset_for).
        self.head = drafter.subset_for(call)
        self.done = False

    def feed(self) -> list[int]:
        """Begins a step: the history gets the last drafted token; the tokens the step runs."""
        if self.tokens:
            self.cache.append(self.tokens[-1:])
        return self.cache.unfed()

    def take(self, logits: torch.Tensor, step_start: float) -> None:
        """Ends the step with the logits of the next token: [vocab], or with
        self.head [len(self.head.token_ids)]."""
        call, cache, head = self.call, self.cache, self.head
        if self.ranks:  # greedy: the token and its runner-up in one pass over the logits
            ranked = adjust_logits(logits[None], call.sampling, len(cache), cache.tokens)[0]
            top = ranked.topk(2).indices
            token, runner_up = (head.token_ids[top] if head is not None else top).tolist()
            drawn = None if call.sampling.masks_tokens and ranked[token] == float("-inf") else (token, None, None)
        elif head is not None:
            drawn = draw_subset(logits, head, call, position=len(cache), first=not self.tokens)
        else:
            drawn = draw(logits, call, position=len(cache), first=not self.tokens, tokens=cache.tokens)
        if drawn is None:  # the grammar (or allowed_ids) allows none of the tokens this draft scores
            if self.tokens:
                cache.crop(len(cache) - 1)  # the history holds the drafted tokens but the last
            self.done = True
            return
        token, prob, dist = drawn
        if self.ranks:
            self.runners_up.append(runner_up)
        self.steps_ms.append((time.perf_counter() - step_start) * 1e3)
        self.tokens.append(token)
        if prob is not None:
            self.probs.append(prob)
            if call.return_dists:
                self.dists.append(dist)
        self.done = len(self.tokens) >= call.num_tokens or self.drafter._doubts(logits, token, call, len(self.tokens),
                                                                                head)

    def proposal(self) -> Proposal:
        steps_ms = self.steps_ms
        if len(self.call.new_tokens) > 1 and len(steps_ms) > 1:
            steps_ms = steps_ms[1:]  # the first step also prefilled: not a draft step's cost
        return Proposal(self.tokens, self.probs, self.dists, len(self.call.new_tokens), self.cropped,
                        (time.perf_counter() - self.start) * 1e3,
                        sum(steps_ms) / len(steps_ms) if steps_ms else 0.0, self.runners_up)


class ModelDrafter:
    """Drafts autoregressively with a small causal LM on a per-session KV cache,
    optionally scoring only a token subset (ReducedHead).

    Under greedy decoding it stops a block early once the draft's probability of
    its own token falls below min_confidence (0 = never): a token it doubts is
    likely rejected, and the tokens after it more so, so drafting them costs
    draft steps for little. The target still verifies every token proposed.

    A cancelled call stops at the next layer, not only at the next step: the
    orchestrator cancels a pre-draft when the verify beside it rejects a token,
    and its fresh draft, on the critical path, queues behind whatever the
    pre-draft still runs (a step costs ~60 ms on a 2-core AVX2 VM). The
    half-run step's keys and values are cropped off
    (SessionCache.drop_partial_step)."""

    def __init__(self, runner: ModelRunner | LeanRunner, store: SessionCacheStore, head: ReducedHead | None = None,
                 min_confidence: float = 0.0):
        self.runner = runner
        self.store = store
        self.head = head
        self.min_confidence = min_confidence
        self.vocab_size = runner.loaded.vocab_size
        self._cancelled: threading.Event | None = None  # of the call running on the worker thread
        if hasattr(runner, "before_layer"):  # tandem.lean.LeanRunner
            runner.before_layer = self._abort_if_cancelled
        else:
            for layer in decoder_layers(runner.model):
                layer.register_forward_pre_hook(lambda module, args: self._abort_if_cancelled())

    def _abort_if_cancelled(self) -> None:
        if self._cancelled is not None and self._cancelled.is_set():
            raise StepAborted

    def _doubts(self, logits: torch.Tensor, token: int, call: ProposeCall, drafted: int,
                head: ReducedHead | None = None) -> bool:
        """Whether to stop after `drafted` tokens, the last `token`, from the
        step's logits (over `head`'s tokens where given): greedy only, and a
        pre-draft keeps at least its bonus guess and one token after it."""
        if not self.min_confidence or not call.sampling.greedy or drafted >= call.num_tokens:
            return False
        if drafted < (2 if call.first_is_bonus_guess else 1):
            return False
        index = token if head is None else int(torch.searchsorted(head.token_ids, token))
        return float(torch.softmax(logits, dim=-1)[index]) < self.min_confidence

    def subset_for(self, call: ProposeCall) -> ReducedHead | None:
        """The reduced head, where a call's tokens are drawn from its logits
        alone, not spread over the whole vocabulary: a call whose sampling
        adjusts no logit (draw_subset); else None."""
        if self.head is None or call.sampling.adjusts or len(self.head.token_ids) < 2:
            return None
        return self.head

    def _next_logits(self, cache: SessionCache, subset: bool = False) -> torch.Tensor:
        """Runs the unfed history through the model; [vocab] logits of the
        next token, or with `subset` the reduced head's [len(token_ids)]."""
        if self.head is None:
            logits = self.runner.forward(cache.kv, cache.unfed(), logits_to_keep=1)[0]
        else:
            hidden = self.runner.last_hidden(cache.kv, cache.unfed())
            logits = self.head.subset_rows(hidden[None])
            logits = (logits if subset else self.head.scatter(logits))[0]
        cache.mark_fed()
        return logits

    def feed(self, cache: SessionCache) -> None:
        """Runs the cache's unfed tokens through the model: a chunk of a long
        prefill (ModelServiceBase.prefill_ahead)."""
        self._next_logits(cache)

    def _draft(self, cache: SessionCache, call: ProposeCall, cancelled: threading.Event, cropped: int,
               start: float) -> Proposal:
        block = _Block(self, cache, call, cropped, start)
        self._cancelled = cancelled
        try:
            while not block.done and not cancelled.is_set():
                step_start = time.perf_counter()
                block.feed()
                try:
                    logits = self._next_logits(cache, subset=block.head is not None)
                except StepAborted:
                    if not cache.drop_partial_step():
                        self.store.release(call.session_id)
                    break
                block.take(logits, step_start)
        except Exception:
            self.store.release(call.session_id)  # a half-written cache is never reused
            raise
        finally:
            self._cancelled = None
        self.store.enforce_budget(keep=call.session_id)
        return block.proposal()

    def propose_batch(self, calls: list[tuple[ProposeCall, threading.Event]]) -> list[Proposal | Exception]:
        """Several sessions' blocks drafted in lockstep (--batch-drafts): each
        step runs every unfinished block's next token through one forward
        (runner.forward_batch: the weights read once for all of them). Each
        block takes its tokens by the rules propose follows; a cache miss fails
        its own call only, and a cancelled call stops at the next step.
        Greedy calls only (DraftServicer.batchable)."""
        if len(calls) == 1:
            try:
                return [self.propose(*calls[0])]
            except Exception as err:
                return [err]
        start = time.perf_counter()
        results: list[Proposal | Exception | None] = [None] * len(calls)
        blocks: list[tuple[int, _Block, threading.Event]] = []
        for index, (call, cancelled) in enumerate(calls):
            try:
                cache, cropped = self.store.checkout(call.session_id, call.prefix_len, call.prefix_fp)
            except Exception as err:  # CacheMiss
                results[index] = err
                continue
            cache.append(call.new_tokens)
            blocks.append((index, _Block(self, cache, call, cropped, start), cancelled))
        try:
            while live := [block for _, block, cancelled in blocks if not block.done and not cancelled.is_set()]:
                step_start = time.perf_counter()
                feeds = [(block.cache.kv, block.feed(), 1) for block in live]
                for block, logits in zip(live, self._batch_logits(feeds, [block.head is not None for block in live])):
                    block.cache.mark_fed()
                    block.take(logits, step_start)
        except Exception as err:
            for index, block, _ in blocks:
                self.store.release(block.call.session_id)  # a half-written cache is never reused
                results[index] = err
            return results
        for index, block, _ in blocks:
            self.store.enforce_budget(keep=block.call.session_id)
            results[index] = block.proposal()
        return results

    def _batch_logits(self, feeds, subset: list[bool]) -> list[torch.Tensor]:
        """[vocab] logits of each feed's next token, the feeds in one forward;
        the reduced head's alone for a feed whose `subset` is True."""
        if self.head is None:
            return [logits[0] for logits in self.runner.forward_batch(feeds)]
        rows = self.head.subset_rows(self.runner.hidden_batch(feeds))
        return [row if alone else self.head.scatter(row[None])[0] for row, alone in zip(rows, subset)]

    def propose(self, call: ProposeCall, cancelled: threading.Event) -> Proposal:
        start = time.perf_counter()
        cache, cropped = self.store.checkout(call.session_id, call.prefix_len, call.prefix_fp)
        cache.append(call.new_tokens)
        return self._draft(cache, call, cancelled, cropped, start)


class NgramModelDrafter(ModelDrafter):
    """Prompt lookup first; the model drafts when the history has no match. The
    model's KV lags behind the history while n-grams hit, and catches up in one
    forward when it is needed. A long prefill still runs into the model in
    chunks (feed, ModelServiceBase.prefill_ahead), so that the catch-up after
    a long prompt or turn is at most its last chunk and the tokens drafted by
    lookup since, not the whole prompt in one forward that holds up every other
    session's drafts."""

    def __init__(self, runner: ModelRunner | LeanRunner, store: SessionCacheStore, head: ReducedHead | None = None,
                 ngram_max: int = 4, min_confidence: float = 0.0):
        super().__init__(runner, store, head, min_confidence)
        self.ngram = NgramDrafter(store, self.vocab_size, ngram_max)

    def _from(self, cache: SessionCache, call: ProposeCall, cancelled: threading.Event, cropped: int) -> Proposal:
        start = time.perf_counter()
        found = self.ngram._lookup_proposal(cache, call, cropped, start)
        if found is None:
            return self._draft(cache, call, cancelled, cropped, start)
        self.store.enforce_budget(keep=call.session_id)
        return found

    def propose(self, call: ProposeCall, cancelled: threading.Event) -> Proposal:
        cache, cropped = self.store.checkout(call.session_id, call.prefix_len, call.prefix_fp)
        cache.append(call.new_tokens)
        if call.first_is_bonus_guess and call.num_tokens > 1:
            return guess_then_fresh(cache, call, lambda c, sub: self._from(c, sub, cancelled, cropped))
        return self._from(cache, call, cancelled, cropped)
